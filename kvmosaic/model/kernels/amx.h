/* The tile unit (AMX) as the kernels use it: the OS's permission and a tile configuration
 * (prefill_attention_amx.c, decode_step.c). KVMOSAIC_AMX is defined where the build has the tile
 * instructions (and KVMOSAIC_NO_AMX does not turn them off). */
#ifndef KVMOSAIC_AMX_H
#define KVMOSAIC_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && !defined(KVMOSAIC_NO_AMX)
#define KVMOSAIC_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands out the tile state only to processes that ask (once; the answer holds for every thread). */
static int amx_permitted(void) {
    static int state; /* 0: not asked; 1: granted; -1: refused (a kernel or hypervisor without AMX state) */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

/* Loads palette 1 on the calling thread: tile register t holds rows[t] rows of 64 bytes (0: not used). */
static inline void amx_configure(const uint8_t rows[8]) {
    struct {
        uint8_t palette_id, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config __attribute__((aligned(64)));
    memset(&config, 0, sizeof config);
    config.palette_id = 1;
    for (int t = 0; t < 8; ++t) config.colsb[t] = rows[t] ? 64 : 0, config.rows[t] = rows[t];
    /* GCC does not count LDTILECFG as reading the whole struct: without this it dropped the stores of
     * colsb and rows (only the palette was written) and the instruction faulted */
    __asm__ __volatile__("" : : "r"(&config) : "memory");
    _tile_loadconfig(&config);
}
#endif
#endif

import sys
from kvmosaic.blend import blender as bl
if sys.argv[1] == "off":
    orig = bl.Blender.prefill
    def prefill(self, *a, fold=False, **k):
        return orig(self, *a, fold=False, **k)
    bl.Blender.prefill = prefill
sys.argv = ["auto_reuse"] + sys.argv[2:]
from benchmarks import auto_reuse
auto_reuse.main()

"""A discrete-event simulator of many engine replicas behind a router.

It drives the real, torch-free cache managers (``BlockPool`` + ``HashCacheManager``, one per
simulated replica; their events feed the router's real ``ClusterIndex``) and the real routing
policies (``kvmosaic.router.policies``); only the time a step takes comes from a cost model
(``cost.py``), calibrated on this engine's measured prefill and decode rates.

``python -m kvmosaic.sim [--quick]`` writes docs/router/sim.{md,json} and plots.
"""

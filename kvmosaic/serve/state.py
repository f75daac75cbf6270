"""Where the ingress finds the router that Ray Serve runs in its process.

Ray Serve pickles a custom ``RequestRouter`` class *by value* (``cloudpickle.register_pickle_by_value``
on the router's module), so every global of ``request_router`` the class's methods name is a
private copy in the process that unpickles it, and a second unpickle in the same process rebinds
the methods to yet another copy. A dict at module level of ``request_router`` is therefore never
the one the ingress imports. This module is imported normally (pickled by reference), so
``ROUTERS`` is one dict per process: the router registers itself here under its deployment's
name, and the ingress (same process: the handle owner) reads it.
"""

from __future__ import annotations

from typing import Any

ROUTERS: dict[str, Any] = {}  # deployment name -> the KVMosaicRouter routing to it in this process


def register(deployment: str, router: Any) -> None:
    ROUTERS[deployment] = router


def get(deployment: str) -> Any | None:
    return ROUTERS.get(deployment)

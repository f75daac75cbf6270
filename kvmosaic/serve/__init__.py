"""``kvmosaic.serve``: N engine replicas on Ray Serve behind one OpenAI API, routed by cache.

* ``replica.EngineReplica``: one engine + its ZeroMQ cache event publisher (own loopback ports),
  answering through the single-process server's own FastAPI app (same validation, same bodies);
  it reports its event endpoints, model facts and load as Ray Serve routing stats;
* ``request_router.KVMosaicRouter``: a Ray Serve ``RequestRouter`` running a
  ``kvmosaic.router`` policy (the code the simulator runs), its index fed by the replicas' events;
* ``ingress.OpenAIIngress``: the HTTP ingress (FastAPI): tokenises once with the engine's chat
  template, derives the tenant's salt, forwards, retries requests whose replica died;
* ``app.build_app`` / ``cli``: ``kvmosaic serve --replicas N --router POLICY``.

Ray Serve provides replicas, placement, health and ingress; kvmosaic provides the decision.
"""

"""The OpenAI-compatible HTTP server (``kvmosaic serve``), its metrics and cache events.

``async_engine`` drives the engine from one thread; ``serving`` answers ``/v1/completions``
and ``/v1/chat/completions``; ``protocol`` and ``responses`` are the request and response
bodies; ``metrics`` is ``/metrics``; ``events`` publishes cache events on ZeroMQ;
``tenancy`` maps API keys to cache salts; ``launch`` starts a server process (for tests,
benchmarks and routers).
"""

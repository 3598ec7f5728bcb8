"""Benchmarks and load tests, beside the rooms: ``engine`` (``blendmatch bench``), ``events``
(event ingest through the directory), ``loadtest`` (``blendmatch loadtest``) and
``gpu_micro`` (the GPU engine on the device), ``locks`` (lock holds on the lookup path under
ingest), ``posters`` (event bodies, posters and the service's targets table of ``loadtest``),
``lmcache_serve`` (LMCache's coordinator for ``loadtest --vs-lmcache``). Nothing imports this package except the CLI's
bench subcommands, lazily; it imports only public names of the rooms.
"""

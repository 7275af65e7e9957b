"""Starting jobs: `keras-ring-run` (under MPI, over TCP, elastic), `kr.run` and
`keras-ring-build`.

The launcher imports the core (the build info, the rendezvous store, the ranks' end
reports) and no framework, so it starts fast.
"""

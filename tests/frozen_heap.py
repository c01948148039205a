"""The last module the fork server of the suite's multi-process runs imports (conftest.py): what the
server holds moves to the collector's permanent generation, so no forked worker's collection walks
(and, touching each object, copies) the server's whole heap again."""

import gc

gc.freeze()

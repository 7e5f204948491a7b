"""`--script` for the launcher test: prints what the rebuild hook exported, as the training sees it."""

import os

import primus_turbo

names = ("PYTHONPATH", "PRIMUS_TURBO_INSTALL_DIR", "PRIMUS_TURBO_COMMIT", "PRIMUS_TURBO_WHEEL")
for name in names:
    print(f"seen {name}={os.environ.get(name, '')}", flush=True)
print(f"seen primus_turbo.COMMIT={primus_turbo.COMMIT}", flush=True)
print(f"seen primus_turbo.__file__={primus_turbo.__file__}", flush=True)

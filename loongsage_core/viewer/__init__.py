"""``loongsage view``: the run viewer, a local web page over run directories (see server.py).

Imports aiohttp; the CLI imports this package only for ``loongsage view``.
"""

from .runs import RunDir, check_run_dir
from .server import ViewerServer, build_app, serve

__all__ = ["RunDir", "ViewerServer", "build_app", "check_run_dir", "serve"]

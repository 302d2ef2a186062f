"""Test support for python/tests/test_pyisolate.py and scripts/pyisolate-suite.sh: on
PYTHONPATH, it makes a pyisolate child slow to start. In a process pyisolate started
(``$PYISOLATE_CHILD``) with ``$TW_PYISOLATE_CHILD_DELAY_S`` set, the first import of
``pyisolate._internal.bootstrap`` sleeps that long: the child has connected to the host's
socket and received its bootstrap message, and has not yet rehydrated the adapter or
imported the extension (where a slow ``import torch`` would land)."""

import os
import sys
import time


class _DelayBootstrap:
    def find_spec(self, name, path=None, target=None):
        if name == "pyisolate._internal.bootstrap":
            sys.meta_path.remove(self)
            time.sleep(float(os.environ["TW_PYISOLATE_CHILD_DELAY_S"]))
        return None


if os.environ.get("PYISOLATE_CHILD") and os.environ.get("TW_PYISOLATE_CHILD_DELAY_S"):
    sys.meta_path.insert(0, _DelayBootstrap())

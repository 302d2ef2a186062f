"""The extension module pyisolate loads in the child for python/tests/pyisolate_host.py
(its behaviour lives in pyisolate_host.TensorExtension)."""

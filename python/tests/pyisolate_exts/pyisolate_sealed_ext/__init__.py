"""The extension module of pyisolate_host.py's sealed-worker scenario (no torch, no
tensorwire: a sealed worker gets neither)."""

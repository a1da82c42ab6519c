"""The speed room: speed and memory options, one registered module each (speed/__init__.py: the interface)."""

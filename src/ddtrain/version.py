"""The version of ddtrain, in a module of its own so that any package can name it without importing the
library facade (ddtrain/__init__.py)."""
__version__ = "0.1.0"

"""The package version, in a leaf module: the manifest and run.json record it without importing the package API."""
__version__ = "0.1.0"

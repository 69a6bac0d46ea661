"""rlcore's built-in plugins. Each is registered in the `rlcore.plugins` entry-point group, like any other."""

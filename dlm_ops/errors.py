"""Exceptions shared by every op family."""


class UnsupportedConfig(Exception):
    """No backend can run this call as asked (or the forced one cannot). The message lists every
    backend's reason; dlm_ops never falls back to a slower path silently."""

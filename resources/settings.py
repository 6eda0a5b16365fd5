"""Where sekali's state lives: :class:`Settings`, from :mod:`resources.storage.settings`."""

from resources.storage.settings import Settings, embedded_redis_socket, state_dir

__all__ = ["Settings", "embedded_redis_socket", "state_dir"]

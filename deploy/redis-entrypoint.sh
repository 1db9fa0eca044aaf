#!/bin/sh
# As the official redis image does: own /data, then exec redis-server as the `redis` user (PID 1 is redis-server,
# which stops cleanly on SIGTERM: the append-only file is flushed).
set -e
if [ "$1" = "redis-server" ] && [ "$(id -u)" = "0" ]; then
  find /data \! -user redis -exec chown redis:redis '{}' +
  exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"

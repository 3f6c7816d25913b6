# Offline stand-in for redis:7.4.2-bookworm (scripts/images.sh --offline): Debian's Redis 7
# (7.0.x in bookworm), run as uid 999 (`redis`, as in the official image). docker-compose.yml takes it through
# REDIS_IMAGE. BASE: the debootstrap image images.sh makes.
ARG BASE=harnessrl/debian-standin:bookworm
FROM ${BASE}
# Unpinned: bookworm's security updates replace redis-server's version on the mirror.
# hadolint ignore=DL3008
RUN groupadd --system --gid 999 redis \
    && useradd --system --uid 999 --gid redis --home-dir /var/lib/redis redis \
    && apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && install -d -o redis -g redis /data
WORKDIR /data
USER 999:999
EXPOSE 6379
CMD ["redis-server"]

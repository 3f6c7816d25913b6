# Offline stand-in for python:3.11.14-slim-bookworm (scripts/images.sh --offline), made from
# Debian's packages only: Python 3.11 with `python`, `pip` and `venv` where the official image
# has them (/usr/local/bin), and its C headers as the official image has them (the engine's
# torch inductor compiles against Python.h at start-up), pip free to install outside a venv as in the official image (the
# build stages install locks/build.txt that way). BASE: the debootstrap image images.sh makes.
ARG BASE=harnessrl/debian-standin:bookworm
FROM ${BASE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3=3.11.2-1+b1 \
       python3-venv=3.11.2-1+b1 python3-dev=3.11.2-1+b1 \
       python3-pip=23.0.1+dfsg-1 \
    && rm -rf /var/lib/apt/lists/* /usr/lib/python3.11/EXTERNALLY-MANAGED \
    && ln -s /usr/bin/python3 /usr/local/bin/python \
    && ln -s /usr/bin/pip3 /usr/local/bin/pip
ENV LANG=C.UTF-8
CMD ["python3"]

# Test base: Debian bookworm (debootstrap from Debian's archive, tests/cluster/images/bases.py)
# with Python 3.11 in a virtual environment first on PATH, as python:*-slim images have
# `python` and `pip` on PATH. Stands in for PYTHON_BASE_IMAGE where no registry can be pulled.
FROM scratch
ADD rootfs.tar /
ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8
RUN python3 -m venv /opt/python && python --version && pip --version
CMD ["python3"]

# Test base: Debian bookworm (debootstrap from Debian's archive, tests/cluster/images/bases.py)
# with Python 3.11 in a virtual environment first on PATH, as python:*-slim images have
# `python` and `pip` on PATH. Stands in for PYTHON_BASE_IMAGE where no registry can be pulled.
# The build machine's own extra CAs (/usr/local/share/ca-certificates/, e.g. a proxy's) are
# trusted, as a company's base image trusts its proxy: pip reaches PyPI through it.
FROM scratch
ADD rootfs.tar /
COPY extra-ca/ /usr/local/share/ca-certificates/
ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
RUN update-ca-certificates && python3 -m venv /opt/python && python --version && pip --version
CMD ["python3"]

# The pod sandbox image of the test node (containerd's sandbox_image): the static pause
# program of tests/cluster/node/pause/, nothing else.
FROM scratch
COPY pause /pause
USER 65535:65535
ENTRYPOINT ["/pause"]

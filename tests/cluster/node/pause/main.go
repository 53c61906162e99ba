// The pod sandbox's pause process for the test node (tests/cluster/node/): no registry can
// be reached here, so the sandbox image is built from this file. It sleeps until SIGTERM or
// SIGINT and reaps nothing else (the kubelet shares no PID namespace in the tests).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT)
	<-ch
}

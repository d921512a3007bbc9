// The pod sandbox ("pause") image's process for the test node: no public registry can be reached, so the
// harness builds this and pins it as containerd's sandbox image. It sleeps until SIGTERM or SIGINT and, as
// PID 1 of a shared PID namespace, reaps children.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			if pid, _ := syscall.Wait4(-1, &status, syscall.WNOHANG, nil); pid <= 0 {
				break
			}
		}
	}
}

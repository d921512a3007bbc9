// A stand-in for go/dispatch's `publish` binary, which cannot be fetched here: a static executable that
// says where it ran from and with which arguments, then exits 0. The node tests look for its first line.
package main

import (
	"fmt"
	"os"
	"strings"
)

func main() {
	self, err := os.Executable()
	if err != nil {
		self = os.Args[0]
	}
	fmt.Printf("publish ran from %s\n", self)
	fmt.Printf("publish args: %s\n", strings.Join(os.Args[1:], " "))
}

// The command line the test suite runs h2spec (../shared/vendor/h2spec)
// through: that copy has no main package.  h2spec-driver -p PORT [-t]
// runs every case against 127.0.0.1:PORT, h2c, or h2 over TLS with -t
// (its certificate not verified); exit status 1 when one fails.
package main

import (
	"flag"
	"os"
	"time"

	"github.com/summerwind/h2spec"
	"github.com/summerwind/h2spec/config"
)

func main() {
	port := flag.Int("p", 0, "the server's port")
	tls := flag.Bool("t", false, "speak h2 over TLS")
	flag.Parse()
	c := &config.Config{Host: "127.0.0.1", Port: *port, Path: "/", Timeout: 2 * time.Second,
		MaxHeaderLen: 4000, TLS: *tls, Insecure: true}
	passed, err := h2spec.Run(c)
	if err != nil || !passed {
		os.Exit(1)
	}
}

// Command etcd is the etcd server, built from go.etcd.io/etcd/server/v3 at the version pinned
// in e2e/versions.env. etcd's own main module has replace directives, so `go install` of it
// fails; this wrapper module calls the same entry point.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}

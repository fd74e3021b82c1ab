// CoreDNS for the real-node tier (harness/nodes.py), with the plugins a cluster's DNS needs
// and no others: the upstream binary links every plugin and its cloud SDKs (route53, azure,
// clouddns, ...), minutes of build on two cores for code the tier never runs. Selecting
// plugins this way is CoreDNS's documented way to build a smaller server
// (coredns/coredns: plugin.cfg, core/dnsserver/zdirectives.go; the order below is
// zdirectives.go's, restricted to these plugins).
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	dnsserver.Directives = []string{"bind", "ready", "health", "errors", "log", "cache", "kubernetes"}
}

func main() { coremain.Run() }

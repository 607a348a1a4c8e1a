// Command coredns is the cluster tests' DNS (tests/cluster.sh dns): CoreDNS
// at the version go.mod pins, with only the plugins the test Corefile names
// (bind, errors, ready, kubernetes) and the ones a CoreDNS server loads
// itself. Upstream's main imports every plugin, and with them the cloud
// SDKs of route53, azure and clouddns, the tracer of trace and QUIC, which
// more than doubled the cluster's cold Go build for a server that answers
// pod and Service names.
package main

import (
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
)

func main() {
	coremain.Run()
}

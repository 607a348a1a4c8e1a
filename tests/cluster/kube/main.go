// Command kube is the cluster tests' Kubernetes in one binary: the first
// argument names the upstream command it runs, at the versions go.mod pins.
//
//	kube etcd ...                     go.etcd.io/etcd/server/v3 (etcdmain)
//	kube kube-apiserver ...           k8s.io/kubernetes/cmd/kube-apiserver
//	kube kube-controller-manager ...  k8s.io/kubernetes/cmd/kube-controller-manager
//	kube kube-scheduler ...           k8s.io/kubernetes/cmd/kube-scheduler
//	kube kubelet ...                  k8s.io/kubernetes/cmd/kubelet
//	kube kubectl ...                  k8s.io/kubectl
//
// One binary, not six: each would link most of Kubernetes again (about a
// minute and 150 MB apiece). A link named after a command (kubectl ->
// kube) runs that command.
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectl "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

// run executes a cobra command with the given arguments and returns its exit code.
func run(c *cobra.Command, args []string) int {
	c.SetArgs(args)
	return cli.Run(c)
}

var commands = map[string]func(args []string) int{
	"etcd": func(args []string) int {
		etcdmain.Main(append([]string{"etcd"}, args...))
		return 0
	},
	"kube-apiserver":          func(args []string) int { return run(apiserver.NewAPIServerCommand(), args) },
	"kube-controller-manager": func(args []string) int { return run(controllermanager.NewControllerManagerCommand(), args) },
	"kube-scheduler":          func(args []string) int { return run(scheduler.NewSchedulerCommand(), args) },
	"kubelet":                 func(args []string) int { return run(kubelet.NewKubeletCommand(context.Background()), args) },
	"kubectl": func(args []string) int {
		c := kubectl.NewDefaultKubectlCommand()
		c.SetArgs(args)
		if err := cli.RunNoErrOutput(c); err != nil {
			kubectlutil.CheckErr(err)
		}
		return 0
	},
}

func main() {
	name, args := filepath.Base(os.Args[0]), os.Args[1:]
	if _, ok := commands[name]; !ok && len(args) > 0 {
		name, args = args[0], args[1:]
	}
	cmd, ok := commands[name]
	if !ok {
		names := make([]string, 0, len(commands))
		for n := range commands {
			names = append(names, n)
		}
		sort.Strings(names)
		fmt.Fprintf(os.Stderr, "usage: kube COMMAND [ARGS...]: COMMAND is one of %v (or run kube through a link of that name)\n", names)
		os.Exit(2)
	}
	os.Exit(cmd(args))
}

//go:build tools

// The controllers the cluster tests run, JobSet's manager and Kubeflow
// Trainer's, are built from this module (tests/cluster.sh build), not from
// their own: their versions are pinned here beside Kubernetes', so the
// Kubernetes libraries they share with `kube` (client-go, apimachinery, the
// API types) compile once for all three. Each from its own module, with its
// own patch versions of those libraries, compiled them again: about 250 s
// of the cold build apiece, against some 45 s for both here.
package tools

import (
	_ "github.com/kubeflow/trainer/v2/cmd/trainer-controller-manager"
	_ "sigs.k8s.io/jobset"
)

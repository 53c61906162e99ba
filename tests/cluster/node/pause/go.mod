module rlhf-operator/tests/cluster/node/pause

go 1.24.0

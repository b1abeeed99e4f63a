//go:build !race

package outbox_test

// raceEnabled says whether the tests run under the race detector, for the
// figures the load test reports.
const raceEnabled = false

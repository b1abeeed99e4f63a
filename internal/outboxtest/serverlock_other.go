//go:build !unix

package outboxtest

import "os"

// Without flock, the lock guards nothing across processes: restart tests
// run only on Linux machines that allow them.
const (
	unlock = iota
	lockShared
	lockExclusive
	lockNonBlocking = 4
)

func flock(*os.File, int) error { return nil }

func wouldBlock(error) bool { return false }

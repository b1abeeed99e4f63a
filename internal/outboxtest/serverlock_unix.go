//go:build unix

package outboxtest

import (
	"errors"
	"os"
	"syscall"
)

// Modes of flock.
const (
	unlock          = syscall.LOCK_UN
	lockShared      = syscall.LOCK_SH
	lockExclusive   = syscall.LOCK_EX
	lockNonBlocking = syscall.LOCK_NB
)

// flock applies how to f's open file, converting a lock it already holds.
func flock(f *os.File, how int) error {
	for {
		err := syscall.Flock(int(f.Fd()), how)
		if !errors.Is(err, syscall.EINTR) {
			return err
		}
	}
}

// wouldBlock reports whether err is a non-blocking flock's refusal.
func wouldBlock(err error) bool { return errors.Is(err, syscall.EWOULDBLOCK) }

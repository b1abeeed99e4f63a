package outboxtest

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// `go test ./...` runs the test binaries of several packages at once, and
// they share the machine's servers: a test that restarts a server must not
// do so while another package's test is using it. Each process therefore
// holds a shared lock (flock) on a file per engine under os.TempDir while
// any of its tests uses that engine's server (UseServer, which Open
// calls), and a restart takes the lock exclusively (ExclusiveServer).
//
// Within one process the lock is counted, not taken per test: a restart
// test runs without t.Parallel, so Go keeps the process's other tests that
// use the server from running meanwhile (parallel ones wait, paused, until
// the sequential ones end), and the restart only has to wait for the other
// processes. A paused test that opened its database before t.Parallel
// holds the count, so waiting for it would never end.
//
// A restart waiting for the lock would starve if other processes' tests
// kept overlapping, each taking it shared while another still held it;
// so it first takes a second file, the gate, exclusively, and a process
// takes the gate shared for as long as it waits for the lock itself: new
// users queue behind a waiting restart, and those already in finish.

// serverLock is the lock of one engine's server, and this process's count
// of the tests that use it.
type serverLock struct {
	path       string // of the lock; the gate's adds ".gate"
	mu         sync.Mutex
	files      sync.Once
	lock, gate *os.File
	err        error
	users      int  // this process's tests using the server
	exclusive  bool // this process holds the lock exclusively
}

var serverLocks = map[Engine]*serverLock{Postgres: newServerLock(Postgres), MySQL: newServerLock(MySQL)}

func newServerLock(e Engine) *serverLock {
	return &serverLock{path: filepath.Join(os.TempDir(), "gorm-outbox-test-"+strings.ToLower(string(e))+".lock")}
}

// open opens the two lock files, once per process.
func (l *serverLock) open() error {
	l.files.Do(func() {
		// flock needs no write access: a file another user created is as
		// good.
		if l.lock, l.err = os.OpenFile(l.path, os.O_RDONLY|os.O_CREATE, 0o666); l.err != nil {
			return
		}
		l.gate, l.err = os.OpenFile(l.path+".gate", os.O_RDONLY|os.O_CREATE, 0o666)
	})
	return l.err
}

// UseServer marks t as using engine e's server until t ends: a restart by
// another process's test (ExclusiveServer) waits until t has ended, and t
// waits here while such a restart is under way. Open calls it before its
// first statement; helpers that reach a server by other means call it
// themselves. It does nothing for SQLite.
func UseServer(t testing.TB, e Engine) {
	t.Helper()
	if l := serverLocks[e]; l != nil {
		l.use(t)
	}
}

func (l *serverLock) use(t testing.TB) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.open(); err != nil {
		t.Fatalf("outboxtest: open the server lock: %v", err)
	}
	if l.users == 0 && !l.exclusive {
		err := flock(l.gate, lockShared)
		if err == nil {
			err = flock(l.lock, lockShared)
			if uerr := flock(l.gate, unlock); err == nil {
				err = uerr
			}
		}
		if err != nil {
			t.Fatalf("outboxtest: lock %s: %v", l.lock.Name(), err)
		}
	}
	l.users++
	t.Cleanup(func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		l.users--
		if l.users == 0 && !l.exclusive {
			if err := flock(l.lock, unlock); err != nil {
				t.Errorf("outboxtest: unlock %s: %v", l.lock.Name(), err)
			}
		}
	})
}

// ExclusiveServer waits until no other process's test uses engine e's
// server, and keeps new ones from starting until release is called (it is
// called when t ends at the latest): from then on t may stop and start
// the server. It does not wait for the tests of its own process, and so
// is only for a test that runs without t.Parallel (see UseServer). It
// fails t if other processes still use the server after timeout.
func ExclusiveServer(t testing.TB, e Engine, timeout time.Duration) (release func()) {
	t.Helper()
	l := serverLocks[e]
	if l == nil {
		t.Fatalf("outboxtest: %s has no server to take", e)
	}
	return l.take(t, timeout)
}

func (l *serverLock) take(t testing.TB, timeout time.Duration) (release func()) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := l.open(); err != nil {
		t.Fatalf("outboxtest: open the server lock: %v", err)
	}
	if l.exclusive {
		t.Fatalf("outboxtest: %s is already held exclusively by this process", l.path)
	}
	// The gate is only ever held shared for a moment (by a process taking
	// the lock shared, which it gets at once unless a restart holds it),
	// or exclusively by another restart, which ends.
	if err := flock(l.gate, lockExclusive); err != nil {
		t.Fatalf("outboxtest: lock %s: %v", l.gate.Name(), err)
	}
	// Converting this process's shared lock may drop it first, and a
	// failed try leaves it dropped: on giving up, it is taken again (at
	// once: no one else can hold the lock exclusively while we hold the
	// gate).
	deadline := time.Now().Add(timeout)
	for {
		err := flock(l.lock, lockExclusive|lockNonBlocking)
		if err == nil {
			break
		}
		if !wouldBlock(err) || time.Now().After(deadline) {
			if l.users > 0 {
				flock(l.lock, lockShared)
			}
			flock(l.gate, unlock)
			if wouldBlock(err) {
				err = fmt.Errorf("other processes still use the server after %v", timeout)
			}
			t.Fatalf("outboxtest: lock %s exclusively: %v", l.lock.Name(), err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	l.exclusive = true
	var once sync.Once
	release = func() {
		once.Do(func() {
			l.mu.Lock()
			defer l.mu.Unlock()
			l.exclusive = false
			how := unlock
			if l.users > 0 {
				how = lockShared
			}
			err := flock(l.lock, how)
			if uerr := flock(l.gate, unlock); err == nil {
				err = uerr
			}
			if err != nil {
				t.Errorf("outboxtest: release %s: %v", l.lock.Name(), err)
			}
		})
	}
	t.Cleanup(release)
	return release
}

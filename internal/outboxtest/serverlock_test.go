package outboxtest

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// lockHelperEnv names, in a copy of this test binary, the server lock that
// TestServerLockHelperProcess holds as a user of the server, for as long
// as lockHelperEnv+"_HOLD" says.
const lockHelperEnv = "OUTBOXTEST_LOCK_HELPER"

// TestServerLockHelperProcess is the other process of the server lock
// tests; it skips unless a test started it.
func TestServerLockHelperProcess(t *testing.T) {
	path := os.Getenv(lockHelperEnv)
	if path == "" {
		t.Skip("skipping: the helper process of TestExclusiveServerWaitsForOtherProcessesAndHoldsThemOff")
	}
	hold, err := time.ParseDuration(os.Getenv(lockHelperEnv + "_HOLD"))
	if err != nil {
		t.Fatal(err)
	}
	(&serverLock{path: path}).use(t)
	fmt.Println("held")
	time.Sleep(hold)
}

// lockHelper is a running TestServerLockHelperProcess; held is closed
// once it holds the lock.
type lockHelper struct{ held chan struct{} }

func startLockHelper(t *testing.T, path string, hold time.Duration) lockHelper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestServerLockHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), lockHelperEnv+"="+path, lockHelperEnv+"_HOLD="+hold.String())
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h := lockHelper{held: make(chan struct{})}
	done := make(chan struct{})
	go func() {
		defer close(done)
		lines := bufio.NewScanner(out)
		for lines.Scan() {
			if lines.Text() == "held" {
				close(h.held)
			}
		}
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		<-done
		cmd.Wait()
	})
	return h
}

func within(t *testing.T, c <-chan struct{}, d time.Duration, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(d):
		t.Fatalf("%s: not within %v", what, d)
	}
}

// TestExclusiveServerWaitsForOtherProcessesAndHoldsThemOff: a restart
// test takes the server only once another process's test has let go of
// it, without waiting for the tests of its own process (a paused parallel
// test would never let go), and a process that comes meanwhile waits for
// the release.
func TestExclusiveServerWaitsForOtherProcessesAndHoldsThemOff(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("skipping: the lock guards processes only where there is flock; tested on Linux")
	}
	path := filepath.Join(t.TempDir(), "server.lock")
	l := &serverLock{path: path}
	l.use(t) // a test of this process that uses the server

	const hold = 700 * time.Millisecond
	within(t, startLockHelper(t, path, hold).held, 10*time.Second, "the helper process to take the lock")
	began := time.Now()
	release := l.take(t, 10*time.Second)
	if waited := time.Since(began); waited < hold-200*time.Millisecond {
		t.Fatalf("took the lock exclusively %v after another process took it to hold for %v", waited, hold)
	}

	ownUse := make(chan struct{})
	go func() { l.use(t); close(ownUse) }()
	within(t, ownUse, 2*time.Second, "a test of the restarting process to use the server")

	late := startLockHelper(t, path, 0)
	select {
	case <-late.held:
		t.Fatal("another process took the lock while it was held exclusively")
	case <-time.After(500 * time.Millisecond):
	}
	release()
	within(t, late.held, 10*time.Second, "the waiting process to take the lock after the release")
}

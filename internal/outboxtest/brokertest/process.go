package brokertest

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// The dispatcher processes are configured through these variables; the
// publisher's own settings travel in the variables the test adds.
const (
	envHelper  = "OUTBOX_BROKERTEST_HELPER"
	envDSN     = "OUTBOX_BROKERTEST_DSN"
	envJournal = "OUTBOX_BROKERTEST_JOURNAL"
	envBatch   = "OUTBOX_BROKERTEST_BATCH"
	envHang    = "OUTBOX_BROKERTEST_HANG"
)

// helperLease is the lease of the dispatcher processes: a killed one's
// batch is claimed again this long after it was claimed.
const helperLease = time.Second

// Main is the TestMain of a broker package whose tests kill dispatcher
// processes: it runs m's tests and exits with their status, except in a
// copy of the test binary that [Processes] started, where it runs a
// dispatcher process instead and exits when the process is signalled
// (SIGINT, SIGTERM) or fails. newPublisher builds that process's
// publisher from the environment the test gave it.
func Main(m *testing.M, newPublisher func() (outbox.Publisher, error)) {
	if os.Getenv(envHelper) != "dispatcher" {
		os.Exit(m.Run())
	}
	if err := runDispatcherProcess(newPublisher); err != nil {
		fmt.Fprintln(os.Stderr, "dispatcher process:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// runDispatcherProcess runs a dispatcher on the SQLite outbox of the test
// that started the process, publishing through newPublisher's publisher.
// Around every publish it appends "start <pid> <batch>" and
// "end <pid> <batch>" to the journal, each line in one write. Between the
// publish and the end line it waits up to 100ms, so that kills land
// between a batch reaching the broker and its settle; with the hang
// variable set, after the first publish that succeeds it appends
// "published <pid> <batch> <event id>..." and waits to be killed.
func runDispatcherProcess(newPublisher func() (outbox.Publisher, error)) error {
	db, err := gorm.Open(outboxtest.Dialector(outboxtest.SQLite, os.Getenv(envDSN)), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return err
	}
	batchSize, err := strconv.Atoi(os.Getenv(envBatch))
	if err != nil {
		return fmt.Errorf("%s: %w", envBatch, err)
	}
	p, err := newPublisher()
	if err != nil {
		return err
	}
	journal, err := os.OpenFile(os.Getenv(envJournal), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	hang := os.Getenv(envHang) == "1"
	pid := os.Getpid()
	pub := outbox.PublisherFunc(func(ctx context.Context, b outbox.Batch) error {
		fmt.Fprintf(journal, "start %d %s\n", pid, b.ID)
		err := p.Publish(ctx, b)
		if hang && err == nil {
			ids := make([]string, len(b.Messages))
			for i, m := range b.Messages {
				ids[i] = m.EventID
			}
			fmt.Fprintf(journal, "published %d %s %s\n", pid, b.ID, strings.Join(ids, " "))
			select {}
		}
		// In the broker, not yet settled: a kill here makes the next
		// dispatcher publish the batch again.
		time.Sleep(rand.N(100 * time.Millisecond))
		fmt.Fprintf(journal, "end %d %s\n", pid, b.ID)
		return err
	})
	d, err := outbox.NewDispatcher(db, pub, outbox.WithBatchSize(batchSize), outbox.WithLease(helperLease),
		outbox.WithPublishTimeout(helperLease/2), outbox.WithPollInterval(20*time.Millisecond),
		outbox.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))))
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return d.Run(ctx)
}

// Processes starts dispatcher processes, copies of the test binary that
// run [Main]'s dispatcher, on the SQLite outbox of one test, and kills
// them with SIGKILL. Every process it started is killed when the test
// ends.
type Processes struct {
	t       *testing.T
	env     []string
	journal string
}

// NewProcesses returns Processes on the SQLite outbox info names, whose
// dispatchers claim batches of batchSize with a one-second lease; env
// ("NAME=value") is added to each process's environment, for the
// publisher Main's newPublisher builds.
func NewProcesses(t *testing.T, info outboxtest.DB, batchSize int, env ...string) *Processes {
	t.Helper()
	if info.Engine != outboxtest.SQLite {
		t.Fatalf("brokertest: dispatcher processes run on SQLite, not %s", info.Engine)
	}
	journal := filepath.Join(t.TempDir(), "journal")
	base := []string{envHelper + "=dispatcher", envDSN + "=" + info.DSN, envJournal + "=" + journal, envBatch + "=" + strconv.Itoa(batchSize)}
	return &Processes{t: t, env: append(base, env...), journal: journal}
}

// start starts a dispatcher process; hang makes it wait to be killed
// after its first batch is in the broker.
func (ps *Processes) start(hang bool) *exec.Cmd {
	ps.t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), ps.env...)
	if hang {
		cmd.Env = append(cmd.Env, envHang+"=1")
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		ps.t.Fatalf("start dispatcher process: %v", err)
	}
	ps.t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}

// kill kills cmd with SIGKILL and waits for it to end.
func (ps *Processes) kill(cmd *exec.Cmd) {
	ps.t.Helper()
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		ps.t.Fatal(err)
	}
	_ = cmd.Wait()
}

// KillDuringPublishes starts a dispatcher process and then, kills times,
// waits until the running process is inside one of its publishes, lets a
// random part of the publish pass, kills the process with SIGKILL if it is
// still inside a publish (else waits for its next) and starts a
// replacement. Then it waits until the last replacement has delivered
// db's outbox, and fails t when a process starts no publish or the
// outbox is not delivered within fifteen seconds of the first start each,
// or when no kill interrupted a batch.
func (ps *Processes) KillDuringPublishes(db *gorm.DB, kills int) {
	ps.t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	cmd := ps.start(false)
	for range kills {
		for {
			for !ps.publishing(cmd.Process.Pid) {
				if time.Now().After(deadline) {
					data, _ := os.ReadFile(ps.journal)
					ps.t.Fatalf("dispatcher process %d never started publishing; journal:\n%s", cmd.Process.Pid, data)
				}
				time.Sleep(2 * time.Millisecond)
			}
			time.Sleep(rand.N(60 * time.Millisecond))
			if ps.publishing(cmd.Process.Pid) {
				break
			}
		}
		ps.kill(cmd)
		cmd = ps.start(false)
	}
	WaitDelivered(ps.t, db, 15*time.Second)
	// The replacement is idle now, so every open batch is a killed one's.
	if n := len(ps.openBatches()); n == 0 {
		ps.t.Fatalf("none of %d kills interrupted a batch", kills)
	} else {
		ps.t.Logf("%d kills, %d of them during a batch", kills, n)
	}
}

// KillBetweenAcknowledgementAndSettle starts a dispatcher process that
// waits to be killed once its first batch is in the broker, before the
// dispatcher settles it; kills it with SIGKILL; starts a replacement;
// and returns the event ids of the killed batch, which the replacement
// publishes again once their lease has passed. It leaves the wait for
// the delivery to the caller ([WaitDelivered]), which may write more
// events first.
func (ps *Processes) KillBetweenAcknowledgementAndSettle() []string {
	ps.t.Helper()
	first := ps.start(true)
	deadline := time.Now().Add(10 * time.Second)
	var killed []string
	for killed == nil {
		if time.Now().After(deadline) {
			data, _ := os.ReadFile(ps.journal)
			ps.t.Fatalf("the first dispatcher process published nothing in 10s; journal:\n%s", data)
		}
		for _, fields := range ps.lines() {
			if fields[0] == "published" && fields[1] == strconv.Itoa(first.Process.Pid) {
				killed = fields[3:]
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	if len(killed) == 0 {
		ps.t.Fatal("the first dispatcher process published an empty batch")
	}
	ps.t.Logf("killed dispatcher process %d after its batch of %v reached the broker", first.Process.Pid, killed)
	ps.kill(first)
	ps.start(false)
	return killed
}

// lines returns the journal's complete lines, split into fields.
func (ps *Processes) lines() [][]string {
	ps.t.Helper()
	data, err := os.ReadFile(ps.journal)
	if os.IsNotExist(err) {
		return nil
	} else if err != nil {
		ps.t.Fatal(err)
	}
	// A line a process is writing right now is left for the next read.
	complete := string(data[:bytes.LastIndexByte(data, '\n')+1])
	var out [][]string
	for _, line := range strings.Split(complete, "\n") {
		if fields := strings.Fields(line); len(fields) >= 3 {
			out = append(out, fields)
		}
	}
	return out
}

// openBatches returns the "<pid> <batch>" of every batch whose publish
// started in a process and has not returned.
func (ps *Processes) openBatches() map[string]bool {
	open := map[string]bool{}
	for _, fields := range ps.lines() {
		key := fields[1] + " " + fields[2]
		switch fields[0] {
		case "start":
			open[key] = true
		case "end":
			delete(open, key)
		}
	}
	return open
}

// publishing reports whether process pid is inside a publish.
func (ps *Processes) publishing(pid int) bool {
	for key := range ps.openBatches() {
		if strings.HasPrefix(key, strconv.Itoa(pid)+" ") {
			return true
		}
	}
	return false
}

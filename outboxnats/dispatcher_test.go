package outboxnats_test

import (
	"bufio"
	"context"
	"errors"
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

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxnats"
)

// The test binary doubles as a dispatcher process: the kill test starts
// copies of it with OUTBOX_NATS_HELPER=dispatcher and kills them.
func TestMain(m *testing.M) {
	if os.Getenv("OUTBOX_NATS_HELPER") == "dispatcher" {
		if err := runDispatcherProcess(); err != nil {
			fmt.Fprintln(os.Stderr, "dispatcher process:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// openOutbox returns a fresh SQLite database with the outbox plugin and
// tables.
func openOutbox(t *testing.T) (*gorm.DB, outboxtest.DB) {
	t.Helper()
	db, info := outboxtest.Open(t, outboxtest.SQLite, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	return db, info
}

// writeEvents commits n events spread over aggregates order/0..order/9,
// and rolls back a transaction with an event of aggregate order/rolledback
// after every tenth. It returns the committed event ids.
func writeEvents(t *testing.T, db *gorm.DB, n int) map[string]bool {
	t.Helper()
	for i := range n {
		err := db.Transaction(func(tx *gorm.DB) error {
			return outbox.Publish(tx, outbox.Event{Type: "order.changed", AggregateType: "order",
				AggregateID: strconv.Itoa(i % 10), Payload: map[string]int{"n": i}})
		})
		if err != nil {
			t.Fatal(err)
		}
		if i%10 == 0 {
			err := db.Transaction(func(tx *gorm.DB) error {
				if err := outbox.Publish(tx, outbox.Event{Type: "order.changed", AggregateType: "order",
					AggregateID: "rolledback", Payload: map[string]int{"n": i}}); err != nil {
					return err
				}
				return errors.New("roll back")
			})
			if err == nil {
				t.Fatal("transaction did not roll back")
			}
		}
	}
	var ids []string
	if err := db.Raw(`SELECT event_id FROM outbox_records`).Scan(&ids).Error; err != nil {
		t.Fatal(err)
	}
	committed := map[string]bool{}
	for _, id := range ids {
		committed[id] = true
	}
	if len(committed) != n {
		t.Fatalf("%d committed events in the table, want %d", len(committed), n)
	}
	return committed
}

// checkStream verifies that the stream holds every committed event exactly
// once, none other, each aggregate's in sequence order.
func checkStream(t *testing.T, s testStream, committed map[string]bool) {
	t.Helper()
	seen := map[string]bool{}
	last := map[string]int64{}
	for _, raw := range s.stored(t) {
		e := toEvent(t, raw.Header, raw.Data)
		switch {
		case !committed[e.ID()]:
			t.Errorf("event %s (%s) reached the stream but was never committed", e.ID(), e.Subject())
		case seen[e.ID()]:
			t.Errorf("event %s is in the stream twice", e.ID())
		}
		seen[e.ID()] = true
		seq, _ := strconv.ParseInt(aggregateSequence(t, e), 10, 64)
		if seq != last[e.Subject()]+1 {
			t.Errorf("%s: sequence %d stored after %d", e.Subject(), seq, last[e.Subject()])
		}
		last[e.Subject()] = seq
	}
	if len(seen) != len(committed) {
		t.Errorf("stream holds %d distinct committed events, want %d", len(seen), len(committed))
	}
}

func TestDispatcherDeliversEveryCommittedEvent(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{})
	db, _ := openOutbox(t)
	committed := writeEvents(t, db, 200)

	p := newPublisher(t, js, outboxnats.WithSubject(s.subject))
	d, err := outbox.NewDispatcher(db, p, outbox.WithBatchSize(64))
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for {
		n, err := d.DispatchOnce(ctx)
		if err != nil {
			t.Fatalf("DispatchOnce: %v", err)
		}
		if n == 0 {
			break
		}
	}
	checkStream(t, s, committed)
	var undelivered int64
	db.Raw(`SELECT count(*) FROM outbox_records WHERE delivery_state <> ?`, outbox.StateDelivered).Scan(&undelivered)
	if undelivered != 0 {
		t.Errorf("%d events not settled as delivered", undelivered)
	}
}

func TestOversizedEventIsDeadLetteredAndTheRestDelivered(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{MaxMsgSize: 4096})
	db, _ := openOutbox(t)
	err := db.Transaction(func(tx *gorm.DB) error {
		return outbox.Publish(tx,
			outbox.Event{Type: "order.changed", AggregateType: "order", AggregateID: "1", Payload: strings.Repeat("x", 8192)},
			outbox.Event{Type: "order.changed", AggregateType: "order", AggregateID: "2", Payload: "small"})
	})
	if err != nil {
		t.Fatal(err)
	}
	d, err := outbox.NewDispatcher(db, newPublisher(t, js, outboxnats.WithSubject(s.subject)),
		outbox.WithLogger(slog.New(slog.DiscardHandler)))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.DispatchOnce(context.Background()); err != nil {
		t.Fatal(err)
	}
	states := map[string]string{}
	for _, r := range outboxtest.Records(t, db, "outbox_records") {
		states[r.AggregateID] = r.DeliveryState
	}
	if states["1"] != outbox.StateFailed || states["2"] != outbox.StateDelivered {
		t.Fatalf("states = %v, want the oversized event failed at once and the other delivered", states)
	}
}

// The kill test's dispatcher processes are configured through these
// variables.
const (
	envHelper  = "OUTBOX_NATS_HELPER"
	envDSN     = "OUTBOX_NATS_HELPER_DSN"
	envPrefix  = "OUTBOX_NATS_HELPER_PREFIX"
	envJournal = "OUTBOX_NATS_HELPER_JOURNAL"
)

// runDispatcherProcess runs a dispatcher on the SQLite file of the test
// that started it, publishing through outboxnats, until killed. Around
// every publish it appends "start <pid> <batch>" and "end <pid> <batch>"
// to the journal, each line with one write; between the publish and the
// end line it waits up to 100ms, so that kills land between a batch
// reaching the stream and its settle.
func runDispatcherProcess() error {
	db, err := gorm.Open(outboxtest.Dialector(outboxtest.SQLite, os.Getenv(envDSN)), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return err
	}
	nc, err := nats.Connect(natsURL())
	if err != nil {
		return err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	prefix := os.Getenv(envPrefix)
	p, err := outboxnats.New(js, outboxnats.WithSubject(func(m outbox.Message) string { return prefix + "." + m.AggregateType }))
	if err != nil {
		return err
	}
	journal, err := os.OpenFile(os.Getenv(envJournal), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	pid := os.Getpid()
	pub := outbox.PublisherFunc(func(ctx context.Context, b outbox.Batch) error {
		fmt.Fprintf(journal, "start %d %s\n", pid, b.ID)
		err := p.Publish(ctx, b)
		// Stored in the stream, not yet settled: a kill here makes the
		// next dispatcher publish the batch again.
		time.Sleep(rand.N(100 * time.Millisecond))
		fmt.Fprintf(journal, "end %d %s\n", pid, b.ID)
		return err
	})
	d, err := outbox.NewDispatcher(db, pub, outbox.WithBatchSize(25), outbox.WithLease(time.Second),
		outbox.WithPublishTimeout(500*time.Millisecond), outbox.WithPollInterval(20*time.Millisecond),
		outbox.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))))
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return d.Run(ctx)
}

// openBatches returns the "<pid> <batch>" of every batch whose publish
// started in a process and has not returned.
func openBatches(t *testing.T, path string) map[string]bool {
	t.Helper()
	open := map[string]bool{}
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return open
	} else if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) != 3 {
			continue
		}
		key := fields[1] + " " + fields[2]
		if fields[0] == "start" {
			open[key] = true
		} else {
			delete(open, key)
		}
	}
	return open
}

// killedMidBatch counts the batches whose publish started in a process
// and never returned.
func killedMidBatch(t *testing.T, path string) int { return len(openBatches(t, path)) }

// publishing reports whether process pid is inside a publish.
func publishing(t *testing.T, path string, pid int) bool {
	for key := range openBatches(t, path) {
		if strings.HasPrefix(key, strconv.Itoa(pid)+" ") {
			return true
		}
	}
	return false
}

// TestKilledDispatcherIsReplacedWithoutLossOrDuplicates kills dispatcher
// processes with SIGKILL while they publish a backlog to NATS and starts
// a new one each time. Within the stream's duplicate window the stream
// ends with every committed event exactly once, in sequence order per
// aggregate, and none of a rolled-back transaction.
func TestKilledDispatcherIsReplacedWithoutLossOrDuplicates(t *testing.T) {
	t.Parallel()
	js := connect(t)
	s := newStream(t, js, jetstream.StreamConfig{Duplicates: 2 * time.Minute})
	db, info := openOutbox(t)
	// The backlog stays within one claim's scan window (1,000 due rows),
	// where a replacement finds the killed batches' expired leases.
	committed := writeEvents(t, db, 600)
	journal := filepath.Join(t.TempDir(), "journal")

	start := func() *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), envHelper+"=dispatcher", envDSN+"="+info.DSN, envPrefix+"="+s.prefix, envJournal+"="+journal)
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatalf("start dispatcher process: %v", err)
		}
		t.Cleanup(func() {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		})
		return cmd
	}

	// Each process is killed during one of its publishes, found in the
	// journal, after a random part of it.
	deadline := time.Now().Add(15 * time.Second)
	const kills = 3
	cmd := start()
	for range kills {
		// Into one of its publishes, then a random part of it; a publish
		// that returned meanwhile makes the test wait for the next one.
		for {
			for !publishing(t, journal, cmd.Process.Pid) {
				if time.Now().After(deadline) {
					data, _ := os.ReadFile(journal)
					t.Fatalf("dispatcher process %d never started publishing; journal:\n%s", cmd.Process.Pid, data)
				}
				time.Sleep(2 * time.Millisecond)
			}
			time.Sleep(rand.N(60 * time.Millisecond))
			if publishing(t, journal, cmd.Process.Pid) {
				break
			}
		}
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = cmd.Wait()
		cmd = start()
	}
	for {
		var left int64
		db.Raw(`SELECT count(*) FROM outbox_records WHERE delivery_state <> ?`, outbox.StateDelivered).Scan(&left)
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d events still undelivered after %d kills", left, kills)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if n := killedMidBatch(t, journal); n == 0 {
		t.Fatalf("none of %d kills interrupted a batch", kills)
	} else {
		t.Logf("%d kills, %d of them during a batch", kills, n)
	}
	checkStream(t, s, committed)
}

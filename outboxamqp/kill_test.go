package outboxamqp_test

import (
	"bufio"
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

	amqp "github.com/rabbitmq/amqp091-go"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxamqp"
)

// The kill test's dispatcher processes are configured through these
// variables.
const (
	envHelper   = "OUTBOX_AMQP_HELPER"
	envDSN      = "OUTBOX_AMQP_HELPER_DSN"
	envExchange = "OUTBOX_AMQP_HELPER_EXCHANGE"
	envJournal  = "OUTBOX_AMQP_HELPER_JOURNAL"
)

// The test binary doubles as a dispatcher process: the kill test starts
// copies of it with OUTBOX_AMQP_HELPER=dispatcher and kills them.
func TestMain(m *testing.M) {
	if os.Getenv(envHelper) == "dispatcher" {
		if err := runDispatcherProcess(); err != nil {
			fmt.Fprintln(os.Stderr, "dispatcher process:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runDispatcherProcess runs a dispatcher on the SQLite file of the test
// that started it, publishing through outboxamqp, until killed. Around
// every publish it appends "start <pid> <batch>" and "end <pid> <batch>"
// to the journal, each line with one write; between the publish and the
// end line it waits up to 100ms, so that kills land between a batch's
// confirms and its settle.
func runDispatcherProcess() error {
	db, err := gorm.Open(outboxtest.Dialector(outboxtest.SQLite, os.Getenv(envDSN)), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return err
	}
	conn, err := amqp.Dial(amqpURL())
	if err != nil {
		return err
	}
	p, err := outboxamqp.New(conn, outboxamqp.WithExchange(os.Getenv(envExchange)), outboxamqp.WithRoutingKey(routeByAggregate))
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

// publishing reports whether process pid is inside a publish.
func publishing(t *testing.T, path string, pid int) bool {
	for key := range openBatches(t, path) {
		if strings.HasPrefix(key, strconv.Itoa(pid)+" ") {
			return true
		}
	}
	return false
}

// TestKilledDispatcherIsReplacedWithoutLoss kills dispatcher processes
// with SIGKILL while they publish a backlog to RabbitMQ and starts a new
// one each time. The queue ends with every committed event at least once
// (RabbitMQ does not deduplicate: the interrupted batches arrive twice),
// first arrivals in sequence order per aggregate, and none of a
// rolled-back transaction.
func TestKilledDispatcherIsReplacedWithoutLoss(t *testing.T) {
	t.Parallel()
	tp := newTopology(t, "#")
	db, info := outboxtest.Open(t, outboxtest.SQLite, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	// The backlog stays within one claim's scan window (1,000 due rows),
	// where a replacement finds the killed batches' expired leases.
	committed := writeEvents(t, db, 600)
	journal := filepath.Join(t.TempDir(), "journal")

	start := func() *exec.Cmd {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), envHelper+"=dispatcher", envDSN+"="+info.DSN, envExchange+"="+tp.exchange, envJournal+"="+journal)
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
	if n := len(openBatches(t, journal)); n == 0 {
		t.Fatalf("none of %d kills interrupted a batch", kills)
	} else {
		t.Logf("%d kills, %d of them during a batch", kills, n)
	}

	seen := map[string]bool{}
	last := map[string]int64{}
	redelivered := 0
	for _, m := range tp.receive(t, len(committed)) {
		e := toEvent(t, m)
		if !committed[e.ID()] {
			t.Errorf("event %s (%s) arrived but was never committed", e.ID(), e.Subject())
		}
		if seen[e.ID()] {
			redelivered++
			continue
		}
		seen[e.ID()] = true
		seq, _ := strconv.ParseInt(aggregateSequence(t, e), 10, 64)
		if seq != last[e.Subject()]+1 {
			t.Errorf("%s: first arrival of sequence %d after %d", e.Subject(), seq, last[e.Subject()])
		}
		last[e.Subject()] = seq
	}
	if len(seen) != len(committed) {
		t.Errorf("consumer saw %d of %d committed events", len(seen), len(committed))
	}
	t.Logf("%d committed events, %d arrived again after the kills", len(committed), redelivered)
}

package outboxkafka_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxkafka"
)

var errRollback = errors.New("rolled back on purpose")

// outboxDB opens a SQLite outbox.
func outboxDB(t *testing.T) *gorm.DB {
	t.Helper()
	db, _ := outboxtest.Open(t, outboxtest.SQLite, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	return db
}

// drain dispatches until a round delivers nothing.
func drain(t *testing.T, d *outbox.Dispatcher) {
	t.Helper()
	for range 100 {
		n, err := d.DispatchOnce(context.Background())
		if err != nil {
			t.Fatalf("DispatchOnce: %v", err)
		}
		if n == 0 {
			return
		}
	}
	t.Fatal("the dispatcher was still delivering after 100 rounds")
}

func TestDispatcherDeliversEveryCommittedEventAndNoneRolledBack(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3)
	topic := uniqueTopic(t)
	db := outboxDB(t)
	committed := map[string]bool{}
	for i := range 30 {
		ev := outbox.Event{
			ID: fmt.Sprintf("tx-%d", i), Type: "order.changed", AggregateType: "order",
			AggregateID: fmt.Sprint(i % 4), Payload: map[string]int{"i": i},
		}
		rollback := i%5 == 0
		err := db.Transaction(func(tx *gorm.DB) error {
			if err := outbox.Publish(tx, ev); err != nil {
				return err
			}
			if rollback {
				return errRollback
			}
			return nil
		})
		if rollback != errors.Is(err, errRollback) {
			t.Fatalf("transaction %d: %v", i, err)
		}
		if !rollback {
			committed[ev.ID] = true
		}
	}
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(topic))
	d, err := outbox.NewDispatcher(db, p, outbox.WithBatchSize(7), outbox.WithPublishTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	drain(t, d)

	got := map[string]int{}
	last := map[string]int64{}
	for _, rec := range consume(t, c.ListenAddrs(), topic, len(committed), 5*time.Second) {
		e := decode(t, rec)
		got[e.ID()]++
		seq := fmt.Sprint(e.Extensions()["aggregatesequence"])
		var n int64
		fmt.Sscan(seq, &n)
		if key := string(rec.Key); n != last[key]+1 {
			t.Errorf("aggregate %s: sequence %d after %d", key, n, last[key])
		} else {
			last[key] = n
		}
	}
	for id := range committed {
		if got[id] != 1 {
			t.Errorf("committed event %s consumed %d times, want once", id, got[id])
		}
	}
	for id := range got {
		if !committed[id] {
			t.Errorf("consumed %s, which is not a committed event", id)
		}
	}
	var undelivered int64
	if err := db.Raw(`SELECT count(*) FROM outbox_records WHERE delivery_state <> 'delivered'`).Scan(&undelivered).Error; err != nil {
		t.Fatal(err)
	}
	if undelivered != 0 {
		t.Errorf("%d rows not delivered", undelivered)
	}
}

func TestDispatcherDeadLettersAnOversizedEventAndHoldsBackItsAggregate(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 1)
	db := outboxDB(t)
	events := []outbox.Event{
		{ID: "big", Type: "t", AggregateType: "order", AggregateID: "1", Payload: strings.Repeat("x", 1<<20)},
		{ID: "after-big", Type: "t", AggregateType: "order", AggregateID: "1", Payload: 1},
		{ID: "other", Type: "t", AggregateType: "order", AggregateID: "2", Payload: 2},
	}
	if err := outbox.Publish(db, events...); err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, newClient(t, c.ListenAddrs()), toTopic(uniqueTopic(t)))
	d, err := outbox.NewDispatcher(db, p)
	if err != nil {
		t.Fatal(err)
	}
	drain(t, d)
	states := map[string]string{}
	rows, err := db.Raw(`SELECT event_id, delivery_state FROM outbox_records`).Rows()
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var id, state string
		if err := rows.Scan(&id, &state); err != nil {
			t.Fatal(err)
		}
		states[id] = state
	}
	want := map[string]string{"big": "failed", "after-big": "pending", "other": "delivered"}
	if fmt.Sprint(states) != fmt.Sprint(want) {
		t.Errorf("states = %v, want %v", states, want)
	}
}

// The test binary doubles as a dispatcher process: with
// OUTBOXKAFKA_HELPER=dispatcher it runs a dispatcher into the Kafka
// cluster at OUTBOXKAFKA_BROKERS until it is killed.
func TestMain(m *testing.M) {
	if os.Getenv("OUTBOXKAFKA_HELPER") == "dispatcher" {
		if err := runDispatcherProcess(); err != nil {
			fmt.Fprintln(os.Stderr, "dispatcher process:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// helperLease is the lease of the dispatcher processes: a killed one's
// batch is claimed again this long after it was claimed.
const helperLease = time.Second

// runDispatcherProcess dispatches the SQLite outbox at OUTBOXKAFKA_DSN into
// the topic OUTBOXKAFKA_TOPIC. After each batch is acknowledged, and
// before the dispatcher settles it, it prints "published" and the batch's
// event IDs on stdout. With OUTBOXKAFKA_HANG=1 it then waits to be killed,
// so that the kill lands between the acknowledgement and the settle.
func runDispatcherProcess() error {
	db, err := gorm.Open(outboxtest.Dialector(outboxtest.SQLite, os.Getenv("OUTBOXKAFKA_DSN")), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return err
	}
	cl, err := kgo.NewClient(kgo.SeedBrokers(strings.Split(os.Getenv("OUTBOXKAFKA_BROKERS"), ",")...), kgo.AllowAutoTopicCreation())
	if err != nil {
		return err
	}
	defer cl.Close()
	topic := os.Getenv("OUTBOXKAFKA_TOPIC")
	hang := os.Getenv("OUTBOXKAFKA_HANG") == "1"
	inner, err := outboxkafka.New(cl, outboxkafka.WithTopic(func(outbox.Message) string { return topic }))
	if err != nil {
		return err
	}
	pub := outbox.PublisherFunc(func(ctx context.Context, b outbox.Batch) error {
		if err := inner.Publish(ctx, b); err != nil {
			return err
		}
		ids := make([]string, len(b.Messages))
		for i, m := range b.Messages {
			ids[i] = m.EventID
		}
		fmt.Println("published", strings.Join(ids, " "))
		if hang {
			select {}
		}
		return nil
	})
	d, err := outbox.NewDispatcher(db, pub, outbox.WithBatchSize(5), outbox.WithLease(helperLease),
		outbox.WithPublishTimeout(helperLease/2), outbox.WithPollInterval(20*time.Millisecond))
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	if err := d.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// startDispatcherProcess starts a dispatcher process and returns it with
// the lines it prints.
func startDispatcherProcess(t *testing.T, env ...string) (*exec.Cmd, <-chan string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), "OUTBOXKAFKA_HELPER=dispatcher"), env...)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start dispatcher process: %v", err)
	}
	lines := make(chan string, 1000)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd, lines
}

func TestDispatcherKilledMidBatchIsReplacedWithoutLosingEvents(t *testing.T) {
	t.Parallel()
	c := newCluster(t, 3)
	topic := uniqueTopic(t)
	db, info := outboxtest.Open(t, outboxtest.SQLite, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	committed, rolledBack := map[string]bool{}, map[string]bool{}
	for i := range 50 {
		ev := outbox.Event{ID: fmt.Sprintf("tx-%d", i), Type: "order.changed", AggregateType: "order",
			AggregateID: fmt.Sprint(i % 5), Payload: map[string]int{"i": i}}
		rollback := i%5 == 4
		err := db.Transaction(func(tx *gorm.DB) error {
			if err := outbox.Publish(tx, ev); err != nil {
				return err
			}
			if rollback {
				return errRollback
			}
			return nil
		})
		if rollback != errors.Is(err, errRollback) {
			t.Fatalf("transaction %d: %v", i, err)
		}
		if rollback {
			rolledBack[ev.ID] = true
		} else {
			committed[ev.ID] = true
		}
	}
	env := []string{"OUTBOXKAFKA_DSN=" + info.DSN, "OUTBOXKAFKA_TOPIC=" + topic, "OUTBOXKAFKA_BROKERS=" + strings.Join(c.ListenAddrs(), ",")}

	// The first process publishes one batch and hangs before settling it.
	first, lines := startDispatcherProcess(t, append(env, "OUTBOXKAFKA_HANG=1")...)
	var killed []string
	select {
	case line, ok := <-lines:
		if !ok {
			t.Fatal("the first dispatcher process ended before it published")
		}
		killed = strings.Fields(strings.TrimPrefix(line, "published"))
	case <-time.After(10 * time.Second):
		t.Fatal("the first dispatcher process published nothing in 10s")
	}
	if err := first.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = first.Wait()

	startDispatcherProcess(t, env...)
	deadline := time.Now().Add(15 * time.Second)
	for {
		var n int64
		if err := db.Raw(`SELECT count(*) FROM outbox_records WHERE delivery_state <> 'delivered'`).Scan(&n).Error; err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d rows still undelivered 15s after the replacement started", n)
		}
		time.Sleep(50 * time.Millisecond)
	}

	seen := map[string]int{}
	next := map[string]int64{}
	for _, rec := range consume(t, c.ListenAddrs(), topic, len(committed)+len(killed), 3*time.Second) {
		e := decode(t, rec)
		id := e.ID()
		seen[id]++
		if rolledBack[id] {
			t.Errorf("topic holds %s of a rolled-back transaction", id)
		}
		if seen[id] > 1 {
			continue
		}
		var seq int64
		fmt.Sscan(fmt.Sprint(e.Extensions()["aggregatesequence"]), &seq)
		if key := string(rec.Key); seq != next[key]+1 {
			t.Errorf("aggregate %s: first copy of sequence %d after %d", key, seq, next[key])
		} else {
			next[key] = seq
		}
	}
	for id := range committed {
		if seen[id] == 0 {
			t.Errorf("committed event %s is not in the topic", id)
		}
	}
	// Kafka does not deduplicate what the dispatcher sends again: the
	// killed batch is in the topic twice, and consumers deduplicate on ce_id.
	for _, id := range killed {
		if seen[id] != 2 {
			t.Errorf("event %s of the killed batch is in the topic %d times, want 2", id, seen[id])
		}
	}
}

func TestDispatcherRetriesABatchTheClusterDidNotAcknowledge(t *testing.T) {
	t.Parallel()
	db := outboxDB(t)
	if err := outbox.Publish(db,
		outbox.Event{ID: "a", Type: "t", AggregateType: "order", AggregateID: "1", Payload: 1},
		outbox.Event{ID: "b", Type: "t", AggregateType: "order", AggregateID: "2", Payload: 2},
	); err != nil {
		t.Fatal(err)
	}
	p := newPublisher(t, newClient(t, []string{"127.0.0.1:1"}), toTopic("unreachable"))
	d, err := outbox.NewDispatcher(db, p, outbox.WithPublishTimeout(500*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := d.DispatchOnce(context.Background()); err != nil {
		t.Fatalf("DispatchOnce: %v", err)
	}
	var retry int64
	if err := db.Raw(`SELECT count(*) FROM outbox_records WHERE delivery_state = 'retry' AND delivery_attempts = 1`).Scan(&retry).Error; err != nil {
		t.Fatal(err)
	}
	if retry != 2 {
		t.Errorf("%d of 2 rows are due for a retry after one attempt", retry)
	}
}

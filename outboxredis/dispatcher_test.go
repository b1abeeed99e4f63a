package outboxredis_test

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

	"github.com/redis/go-redis/v9"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxredis"
)

// The test binary doubles as a dispatcher process: with
// OUTBOXREDIS_HELPER=dispatcher it runs a dispatcher into Redis until it is
// killed.
func TestMain(m *testing.M) {
	if os.Getenv("OUTBOXREDIS_HELPER") == "dispatcher" {
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

// runDispatcherProcess dispatches the SQLite outbox at OUTBOXREDIS_DSN into
// the stream OUTBOXREDIS_STREAM. After each batch is in Redis, and before
// the dispatcher settles it, it prints "published" and the batch's event
// IDs on stdout. With OUTBOXREDIS_HANG=1 it then waits to be killed, so
// that the kill lands between the broker's acknowledgement and the settle.
func runDispatcherProcess() error {
	db, err := gorm.Open(outboxtest.Dialector(outboxtest.SQLite, os.Getenv("OUTBOXREDIS_DSN")), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return err
	}
	rdb := redis.NewClient(&redis.Options{Addr: redisAddr(), ContextTimeoutEnabled: true})
	defer rdb.Close()
	stream := os.Getenv("OUTBOXREDIS_STREAM")
	hang := os.Getenv("OUTBOXREDIS_HANG") == "1"
	inner, err := outboxredis.New(rdb, outboxredis.WithStream(func(outbox.Message) string { return stream }))
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
func startDispatcherProcess(t *testing.T, dsn, stream string, hang bool) (*exec.Cmd, <-chan string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "OUTBOXREDIS_HELPER=dispatcher", "OUTBOXREDIS_DSN="+dsn, "OUTBOXREDIS_STREAM="+stream)
	if hang {
		cmd.Env = append(cmd.Env, "OUTBOXREDIS_HANG=1")
	}
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

var errRollback = errors.New("rolled back on purpose")

// outboxDB opens a SQLite outbox and returns its DSN too.
func outboxDB(t *testing.T) (*gorm.DB, string) {
	t.Helper()
	db, info := outboxtest.Open(t, outboxtest.SQLite, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	return db, info.DSN
}

// writeEvents commits n transactions of one event each over aggregates
// aggregates, and rolls back every fifth; it returns the committed IDs
// and the rolled-back ones.
func writeEvents(t *testing.T, db *gorm.DB, prefix string, n, aggregates int) (committed, rolledBack map[string]bool) {
	t.Helper()
	committed, rolledBack = map[string]bool{}, map[string]bool{}
	for i := range n {
		ev := outbox.Event{
			ID: fmt.Sprintf("%s-%d", prefix, i), Type: "order.changed", AggregateType: "order",
			AggregateID: fmt.Sprint(i % aggregates), Payload: map[string]int{"i": i},
		}
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
	return committed, rolledBack
}

// checkStream checks that the stream holds every committed event at least
// once, none of rolledBack, each aggregate's first copies in sequence
// order, and returns how often it holds each ID.
func checkStream(t *testing.T, rdb *redis.Client, stream string, committed, rolledBack map[string]bool) map[string]int {
	t.Helper()
	seen := map[string]int{}
	next := map[string]int64{}
	for _, x := range entries(t, rdb, stream) {
		e := decode(t, x)
		id := e.ID()
		seen[id]++
		if rolledBack[id] {
			t.Errorf("stream holds %s of a rolled-back transaction", id)
		}
		if seen[id] > 1 {
			continue
		}
		var seq int64
		fmt.Sscan(field(x, "aggregatesequence"), &seq)
		if agg := e.Subject(); seq != next[agg]+1 {
			t.Errorf("aggregate %s: first copy of sequence %d after %d", agg, seq, next[agg])
		} else {
			next[agg] = seq
		}
	}
	for id := range committed {
		if seen[id] == 0 {
			t.Errorf("committed event %s is not in the stream", id)
		}
	}
	return seen
}

func undelivered(t *testing.T, db *gorm.DB) int64 {
	t.Helper()
	var n int64
	if err := db.Raw(`SELECT count(*) FROM outbox_records WHERE delivery_state <> 'delivered'`).Scan(&n).Error; err != nil {
		t.Fatal(err)
	}
	return n
}

func TestDispatcherDeliversEveryCommittedEventAndNoneRolledBack(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	db, _ := outboxDB(t)
	committed, rolledBack := writeEvents(t, db, "tx", 40, 4)

	p := newPublisher(t, rdb, toStream(stream))
	d, err := outbox.NewDispatcher(db, p, outbox.WithBatchSize(7))
	if err != nil {
		t.Fatal(err)
	}
	for {
		n, err := d.DispatchOnce(context.Background())
		if err != nil {
			t.Fatalf("DispatchOnce: %v", err)
		}
		if n == 0 {
			break
		}
	}
	for id, n := range checkStream(t, rdb, stream, committed, rolledBack) {
		if n != 1 {
			t.Errorf("event %s is in the stream %d times, want once", id, n)
		}
	}
	if n := undelivered(t, db); n != 0 {
		t.Errorf("%d rows not delivered", n)
	}
}

func TestDispatcherKilledMidBatchIsReplacedWithoutLosingEvents(t *testing.T) {
	t.Parallel()
	rdb := newRedis(t)
	stream := uniqueStream(t, rdb)
	db, dsn := outboxDB(t)
	committed, rolledBack := writeEvents(t, db, "tx", 50, 5)

	// The first process publishes one batch and hangs before settling it.
	first, lines := startDispatcherProcess(t, dsn, stream, true)
	var killed []string // the batch in Redis but not settled when the kill came
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

	startDispatcherProcess(t, dsn, stream, false)
	moreCommitted, moreRolledBack := writeEvents(t, db, "late", 10, 5)
	for id := range moreCommitted {
		committed[id] = true
	}
	for id := range moreRolledBack {
		rolledBack[id] = true
	}
	deadline := time.Now().Add(15 * time.Second)
	for undelivered(t, db) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d rows still undelivered 15s after the replacement started", undelivered(t, db))
		}
		time.Sleep(50 * time.Millisecond)
	}

	seen := checkStream(t, rdb, stream, committed, rolledBack)
	p := newPublisher(t, rdb)
	idmp, err := p.Idempotent(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := 2 // the replacement sent the killed batch again
	if idmp {
		want = 1
	}
	for _, id := range killed {
		if seen[id] != want {
			t.Errorf("event %s of the killed batch is in the stream %d times, want %d (IDMP %v)", id, seen[id], want, idmp)
		}
	}
}

// states returns the delivery state and attempts of every row by event ID.
func states(t *testing.T, db *gorm.DB) map[string]string {
	t.Helper()
	rows, err := db.Raw(`SELECT event_id, delivery_state, delivery_attempts FROM outbox_records`).Rows()
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	got := map[string]string{}
	for rows.Next() {
		var id, state string
		var attempts int
		if err := rows.Scan(&id, &state, &attempts); err != nil {
			t.Fatal(err)
		}
		got[id] = fmt.Sprintf("%s/%d", state, attempts)
	}
	return got
}

func TestDispatcherSettlesAccordingToTheFault(t *testing.T) {
	t.Parallel()
	events := []outbox.Event{
		{ID: "big", Type: "t", AggregateType: "order", AggregateID: "1", Payload: strings.Repeat("x", 2<<10)},
		{ID: "after-big", Type: "t", AggregateType: "order", AggregateID: "1", Payload: 1},
		{ID: "other", Type: "t", AggregateType: "order", AggregateID: "2", Payload: 2},
	}
	rdb := newRedis(t)
	for _, tc := range []struct {
		name string
		pub  func(t *testing.T) *outboxredis.Publisher
		want map[string]string // state/attempts
	}{
		{"oversized message dead-lettered alone", func(t *testing.T) *outboxredis.Publisher {
			p := newPublisher(t, rdb, toStream(uniqueStream(t, rdb)))
			p.LimitArgumentBytes(1 << 10)
			return p
		}, map[string]string{"big": "failed/1", "after-big": "pending/0", "other": "delivered/1"}},
		{"unreachable server retried", func(t *testing.T) *outboxredis.Publisher {
			down := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true, MaxRetries: -1})
			t.Cleanup(func() { down.Close() })
			return newPublisher(t, down)
		}, map[string]string{"big": "retry/1", "after-big": "retry/1", "other": "retry/1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db, _ := outboxDB(t)
			if err := outbox.Publish(db, events...); err != nil {
				t.Fatal(err)
			}
			d, err := outbox.NewDispatcher(db, tc.pub(t), outbox.WithPublishTimeout(2*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			if _, err := d.DispatchOnce(context.Background()); err != nil {
				t.Fatalf("DispatchOnce: %v", err)
			}
			if got := states(t, db); fmt.Sprint(got) != fmt.Sprint(tc.want) {
				t.Errorf("rows = %v, want %v", got, tc.want)
			}
		})
	}
}

// Command example is a small order service that shows the outbox from end
// to end, with nothing to set up:
//
//	go run ./example
//
// Every write of an order, kept in a temporary SQLite file, records an event
// in the same transaction. A dispatcher driven by a cron scheduler delivers
// the events over HTTP to a gateway that the program runs itself and that,
// to show retries, refuses the first request (503) and the third (429 with
// Retry-After: 1). The program prints what the gateway accepted.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxhttp"
)

// Order is the business model.
type Order struct {
	ID       uint   `json:"id"`
	Customer string `json:"customer"`
	Status   string `json:"status"`
}

// OutboxEvents makes Order an outbox.Emitter: the plugin records its events
// in the transaction of every create, update and delete of an order. It
// must be a pure function of the order, with no I/O.
func (o *Order) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return []outbox.Event{{
		Type:          orderEventTypes[op],
		AggregateType: "order",
		AggregateID:   fmt.Sprint(o.ID),
		Payload:       o, // the order as written, encoded as JSON
	}}, nil
}

var orderEventTypes = map[outbox.Op]string{
	outbox.OpCreate: "order.created",
	outbox.OpUpdate: "order.updated",
	outbox.OpDelete: "order.deleted",
}

func main() {
	if err := run(context.Background(), os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "example:", err)
		os.Exit(1)
	}
}

// run is the whole service. It fails if an event is not delivered in time,
// or if the gateway saw something it must not have.
func run(ctx context.Context, out io.Writer) error {
	// 1. The database, the outbox plugin and the tables. WAL lets the
	// dispatcher read while the service writes; _txlock=immediate makes a
	// write transaction take SQLite's lock up front, _busy_timeout wait for it.
	dir, err := os.MkdirTemp("", "outbox-example-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	dsn := "file:" + filepath.Join(dir, "orders.db") + "?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate"
	db, err := gorm.Open(sqlite.Open(dsn), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return fmt.Errorf("open database: %w", err)
	}
	if sqlDB, err := db.DB(); err == nil {
		defer sqlDB.Close()
	}
	if err := db.Use(outbox.Plugin()); err != nil {
		return err
	}
	if err := outbox.AutoMigrate(db); err != nil {
		return err
	}
	if err := db.AutoMigrate(&Order{}); err != nil {
		return err
	}

	// 2. The gateway, on a loopback port. It shares a secret with the
	// publisher, which signs every request. (Keep real secrets out of code.)
	secret := []byte("example-shared-secret")
	gw := &gateway{secret: secret, seen: map[string]bool{}, byOrder: map[string][]string{}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	srv := &http.Server{Handler: gw}
	go srv.Serve(ln)
	defer srv.Close()
	url := "http://" + ln.Addr().String() + "/events"

	// 3. The dispatcher and its schedule. The publisher POSTs each batch to
	// the gateway: a 2xx accepts it, a 408, 429 or 5xx is retried (after at
	// least Retry-After, if given), any other status dead-letters it.
	pub, err := outboxhttp.New(url, outboxhttp.WithSecret(secret))
	if err != nil {
		return err
	}
	d, err := outbox.NewDispatcher(db, pub,
		outbox.WithBatchSize(4), // so that this handful of events takes a few requests
		// A fraction of a second instead of the default 1m, 5m, 25m, ...
		outbox.WithRetryPolicy(outbox.ExponentialBackoff{Initial: 300 * time.Millisecond, Multiplier: 2, Max: 2 * time.Second, Jitter: 0.2}),
	)
	if err != nil {
		return err
	}
	sched, err := outbox.NewScheduler(d, outbox.Schedule{
		Dispatch:    "* * * * * *",   // every second (the first field is seconds)
		RetryFailed: "0 */5 * * * *", // events that ran out of attempts back to pending every 5 minutes
		Cleanup:     "@hourly",       // delete delivered rows older than the retention
	})
	if err != nil {
		return err
	}
	sched.Start()
	defer sched.Stop(context.Background()) // lets the batch in flight settle; a second Stop is harmless

	// 4. Business writes, while the dispatcher runs. Each write and the event
	// the plugin adds to its transaction commit together, or neither does.
	db = db.WithContext(ctx)
	orders := []*Order{{Customer: "Alice", Status: "new"}, {Customer: "Bob", Status: "new"},
		{Customer: "Carol", Status: "new"}, {Customer: "Dave", Status: "new"}}
	for _, o := range orders {
		if err := db.Create(o).Error; err != nil {
			return err
		}
	}
	alice, bob, carol, dave := orders[0], orders[1], orders[2], orders[3]
	// Update through the model, which has its primary key: one order
	// changes, and it records one event. (An update by condition, say
	// Where("status = ?", "new"), records one event per row it changes.)
	for _, u := range []struct {
		order  *Order
		status string
	}{{alice, "paid"}, {bob, "paid"}, {alice, "shipped"}} {
		if err := db.Model(u.order).Update("status", u.status).Error; err != nil {
			return err
		}
	}

	// A transaction that fails after creating an order: the order and its
	// event roll back together.
	ghost := Order{Customer: "Eve", Status: "new"}
	declined := errors.New("payment declined")
	if err := db.Transaction(func(tx *gorm.DB) error {
		if err := tx.Create(&ghost).Error; err != nil {
			return err
		}
		return declined
	}); !errors.Is(err, declined) {
		return fmt.Errorf("the failing transaction: %v, want %v", err, declined)
	}

	// An event that no model write produces, recorded with outbox.Publish in
	// the caller's transaction. The idempotency key makes a repeat a no-op.
	if err := db.Transaction(func(tx *gorm.DB) error {
		return outbox.Publish(tx, outbox.Event{
			Type:           "order.reminder_sent",
			AggregateType:  "order",
			AggregateID:    fmt.Sprint(carol.ID),
			IdempotencyKey: fmt.Sprintf("order-%d-payment-reminder-1", carol.ID),
			Payload:        carol,
		})
	}); err != nil {
		return err
	}
	if err := db.Delete(dave).Error; err != nil {
		return err
	}
	fmt.Fprintf(out, "wrote 4 orders, 3 status changes, 1 reminder, 1 deletion; order %d (%s) rolled back\n", ghost.ID, ghost.Customer)

	// 5. Wait, at most 15 seconds, until every event is delivered; then stop
	// and print what the gateway accepted.
	s, waitErr := waitForDelivery(ctx, d, 15*time.Second)
	if err := sched.Stop(context.Background()); err != nil {
		return err
	}
	gw.mu.Lock()
	defer gw.mu.Unlock()
	written := s.Delivered + s.Undelivered()
	fmt.Fprintf(out, "\noutbox rows written:  %d\n", written)
	fmt.Fprintf(out, "delivered:            %d of %d\n", s.Delivered, written)
	fmt.Fprintf(out, "refused:              %d requests: %s\n", len(gw.refused), strings.Join(gw.refused, ", "))
	fmt.Fprintf(out, "retried:              %d events accepted on a later attempt\n", gw.retried)
	fmt.Fprintf(out, "\nevents accepted per order (sequence, type):\n")
	for _, o := range orders {
		name := fmt.Sprintf("order %d (%s):", o.ID, o.Customer)
		fmt.Fprintf(out, "  %-18s %s\n", name, strings.Join(gw.byOrder[fmt.Sprint(o.ID)], " → "))
	}
	if waitErr != nil {
		return waitErr
	}
	// Every event was delivered: one of the rolled-back order would have
	// reached the gateway.
	if n := len(gw.byOrder[fmt.Sprint(ghost.ID)]); n > 0 {
		return fmt.Errorf("the gateway accepted %d events of the rolled-back order %d", n, ghost.ID)
	}
	fmt.Fprintf(out, "\nrolled back: order %d (%s) was never seen by the gateway\n", ghost.ID, ghost.Customer)
	return nil
}

// waitForDelivery polls the dispatcher's Stats until no event is left
// undelivered, one is dead-lettered, or limit passes, and returns the last.
func waitForDelivery(ctx context.Context, d *outbox.Dispatcher, limit time.Duration) (outbox.Stats, error) {
	ctx, cancel := context.WithTimeoutCause(ctx, limit, fmt.Errorf("not every event was delivered within %v", limit))
	defer cancel()
	var last outbox.Stats
	for {
		s, err := d.Stats(ctx)
		switch {
		case ctx.Err() != nil:
			return last, fmt.Errorf("%w (%d undelivered)", context.Cause(ctx), last.Undelivered())
		case err != nil:
			return last, err
		case s.Failed > 0:
			return s, fmt.Errorf("%d events dead-lettered, the last: %s", s.Failed, s.LastFailure)
		case s.Undelivered() == 0:
			return s, nil
		}
		last = s
		time.Sleep(100 * time.Millisecond)
	}
}

// gateway is the receiving service the publisher posts batches to.
type gateway struct {
	secret   []byte
	mu       sync.Mutex
	requests int
	refused  []string            // per refused request, its status and size
	seen     map[string]bool     // the event IDs accepted
	byOrder  map[string][]string // per order ID, its events in the order accepted
	retried  int                 // events accepted on a later attempt
}

func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// DecodeRequest bounds the body, verifies the signature before parsing,
	// and checks the batch against its headers. A 4xx dead-letters the batch.
	batch, err := outboxhttp.DecodeRequest(r, g.secret, 0)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.requests++
	switch g.requests {
	case 1: // overloaded: retried after the retry policy's backoff
		g.refused = append(g.refused, fmt.Sprintf("503 (%d events)", len(batch.Messages)))
		http.Error(w, "warming up", http.StatusServiceUnavailable)
		return
	case 3: // rate limited: retried after a second at least
		g.refused = append(g.refused, fmt.Sprintf("429 with Retry-After: 1 (%d events)", len(batch.Messages)))
		w.Header().Set("Retry-After", "1")
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return
	}

	// Accept the batch: a 2xx accepts every message of it, any other answer
	// none. Delivery is at least once, so skip what was accepted before.
	for _, m := range batch.Messages {
		if g.seen[m.EventID] {
			continue
		}
		g.seen[m.EventID] = true
		if m.Attempt > 1 {
			g.retried++
		}
		g.byOrder[m.AggregateID] = append(g.byOrder[m.AggregateID], fmt.Sprintf("%d %s", m.Sequence, m.EventType))
	}
	w.WriteHeader(http.StatusOK)
}

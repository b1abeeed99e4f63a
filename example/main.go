// Command example is a small order service that shows the outbox from end
// to end, with nothing to set up:
//
//	go run ./example
//
// It keeps its orders in an embedded SQLite file, in a temporary directory
// that it removes when it ends, and delivers the order events to an HTTP
// gateway that it runs itself on a loopback port. The gateway checks each
// request's signature, deduplicates on event_id and, to show retries at
// work, refuses the first request (503) and the third (429).
//
// The steps, in the order run follows them:
//
//  1. Register the outbox plugin and migrate its tables and the Order model.
//     Order implements outbox.Emitter, so every create, update and delete of
//     an order writes an event in the same transaction.
//  2. Start the gateway.
//  3. Create a dispatcher with the outboxhttp publisher and drive it with a
//     cron scheduler, before any data is written.
//  4. Write orders: creates, updates and a delete; a transaction that rolls
//     back, whose event must never be delivered; and an explicit event
//     recorded with outbox.Publish.
//  5. Wait until every committed event is delivered, stop the scheduler and
//     print an account of what the gateway accepted.
package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"gorm.io/driver/sqlite"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxhttp"
)

// deliveryLimit bounds how long run waits for every committed event to be
// delivered.
const deliveryLimit = 15 * time.Second

// Order is the business model. Its table is "orders".
type Order struct {
	ID       uint   `json:"id"`
	Customer string `json:"customer"`
	Status   string `json:"status"`
	Total    int    `json:"total"` // in cents
}

// OutboxEvents makes Order an outbox.Emitter: after every create, update and
// delete of an order, the plugin records the events returned here in the
// same transaction as the write. It must be a pure function of the order.
func (o *Order) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	var typ string
	switch op {
	case outbox.OpCreate:
		typ = "order.created"
	case outbox.OpUpdate:
		typ = "order.updated"
	case outbox.OpDelete:
		typ = "order.deleted"
	default:
		return nil, fmt.Errorf("order %d: unexpected write %q", o.ID, op)
	}
	return []outbox.Event{{
		Type:          typ,
		AggregateType: "order",
		AggregateID:   strconv.FormatUint(uint64(o.ID), 10),
		Payload:       o, // the order as written, encoded as JSON
	}}, nil
}

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "example:", err)
		os.Exit(1)
	}
}

// run is the whole service: it sets everything up, writes orders, waits for
// their events to be delivered and prints the account to out. It returns an
// error when an event was not delivered in time, or when the gateway saw
// something it must not have seen.
func run(ctx context.Context, out io.Writer) error {
	start := time.Now()
	// The dispatcher logs refused batches at Warn: they go to stderr, the
	// account to out.
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))

	// 1. The database, the plugin and the tables.
	dir, err := os.MkdirTemp("", "outbox-example-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	// WAL lets the dispatcher read while the service writes; _txlock=immediate
	// makes write transactions take the lock up front instead of failing on
	// an upgrade; _busy_timeout makes them wait for it.
	dsn := "file:" + filepath.Join(dir, "orders.db") + "?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate"
	db, err := gorm.Open(sqlite.Open(dsn), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return fmt.Errorf("open database: %w", err)
	}
	sqlDB, err := db.DB()
	if err != nil {
		return err
	}
	defer sqlDB.Close()

	if err := db.Use(outbox.Plugin()); err != nil {
		return fmt.Errorf("register outbox plugin: %w", err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		return err
	}
	if err := db.AutoMigrate(&Order{}); err != nil {
		return fmt.Errorf("migrate orders: %w", err)
	}

	// 2. The gateway, on a loopback port chosen by the system. Publisher and
	// gateway share a secret: every request is signed and verified.
	secret := make([]byte, 32)
	rand.Read(secret)
	gw := &gateway{secret: secret, seen: map[string]bool{}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fmt.Errorf("gateway: %w", err)
	}
	srv := &http.Server{Handler: gw, ReadHeaderTimeout: 5 * time.Second}
	go srv.Serve(ln)
	defer shutdown(srv)
	url := "http://" + ln.Addr().String() + "/events"

	// 3. The dispatcher and its schedule. The publisher POSTs each batch to
	// the gateway; a 2xx accepts the batch, a 408, 429 or 5xx is retried
	// after the retry policy's backoff, any other status dead-letters it.
	pub, err := outboxhttp.New(url, outboxhttp.WithSecret(secret), outboxhttp.WithTimeout(2*time.Second))
	if err != nil {
		return err
	}
	d, err := outbox.NewDispatcher(db, pub,
		// Small batches, so that this handful of events takes a few requests.
		outbox.WithBatchSize(4),
		// Seconds instead of the production default (1m, 5m, 25m, ...).
		outbox.WithRetryPolicy(honourRetryAfter(outbox.ExponentialBackoff{
			Initial: 300 * time.Millisecond, Multiplier: 2, Max: 2 * time.Second, Jitter: 0.2,
		})),
		outbox.WithMaxAttempts(5), // then dead-lettered, until the retry_failed sweep
		// How long an event waits, when held back behind an earlier event of
		// its order that is being retried, before it is looked at again.
		outbox.WithPollInterval(250*time.Millisecond),
		outbox.WithPublishTimeout(3*time.Second), // must be shorter than the lease
		outbox.WithLease(10*time.Second),
		outbox.WithRetention(24*time.Hour), // delivered rows kept for a day
		outbox.WithLogger(log),
	)
	if err != nil {
		return err
	}
	sched, err := outbox.NewScheduler(d, outbox.Schedule{
		Dispatch:    "* * * * * *",   // every second (the fields start with seconds)
		RetryFailed: "0 */5 * * * *", // dead-lettered rows back to pending every 5 minutes
		Cleanup:     "@hourly",       // delete delivered rows older than the retention
	})
	if err != nil {
		return err
	}
	sched.Start()
	defer stopScheduler(sched) // on early returns; stopping twice is harmless

	fmt.Fprintf(out, "order service: SQLite in %s (removed at exit), gateway at %s\n", dir, url)

	// 4. Business writes. The dispatcher is already running: it delivers
	// only what has committed.
	ghost, err := writeOrders(ctx, db, out)
	if err != nil {
		return err
	}

	// 5. Wait for delivery, stop, account.
	waitErr := waitForDelivery(ctx, db, deliveryLimit)
	elapsed := time.Since(start)
	if err := stopScheduler(sched); err != nil {
		return fmt.Errorf("stop scheduler: %w", err)
	}
	states, err := outboxStates(context.WithoutCancel(ctx), db)
	if err != nil {
		return err
	}
	ghostRows, err := rowsOfAggregate(context.WithoutCancel(ctx), db, "order", ghost.ID)
	if err != nil {
		return err
	}
	reportErr := report(out, gw.snapshot(), states, ghost, ghostRows, elapsed)
	return errors.Join(waitErr, reportErr)
}

// writeOrders is the service at work. It returns the order of the
// transaction that rolled back.
func writeOrders(ctx context.Context, db *gorm.DB, out io.Writer) (Order, error) {
	db = db.WithContext(ctx)

	// Each write below runs in GORM's own transaction, and the plugin writes
	// the order's event in it: the order row and its outbox row commit
	// together or not at all.
	alice := Order{Customer: "Alice", Status: "new", Total: 4200}
	bob := Order{Customer: "Bob", Status: "new", Total: 1999}
	carol := Order{Customer: "Carol", Status: "new", Total: 7500}
	dave := Order{Customer: "Dave", Status: "new", Total: 1250}
	for _, o := range []*Order{&alice, &bob, &carol, &dave} {
		if err := db.Create(o).Error; err != nil {
			return Order{}, fmt.Errorf("create order for %s: %w", o.Customer, err)
		}
	}
	for _, u := range []struct {
		order  *Order
		status string
	}{{&alice, "paid"}, {&bob, "paid"}, {&alice, "shipped"}} {
		// Update through the model (it has its primary key), so the plugin
		// knows which order changed. A bulk update by condition would be
		// refused with outbox.ErrUnidentifiedRows.
		if err := db.Model(u.order).Update("status", u.status).Error; err != nil {
			return Order{}, fmt.Errorf("order %d: %w", u.order.ID, err)
		}
	}

	// A transaction that fails after creating an order: the order row and
	// its order.created outbox row roll back together, so the event is never
	// delivered.
	var ghost Order
	errDeclined := errors.New("payment declined")
	rollback := db.Transaction(func(tx *gorm.DB) error {
		ghost = Order{Customer: "Eve", Status: "new", Total: 9900}
		if err := tx.Create(&ghost).Error; err != nil {
			return err
		}
		return errDeclined // roll back
	})
	if !errors.Is(rollback, errDeclined) {
		return Order{}, fmt.Errorf("the failing transaction: %v, want %v", rollback, errDeclined)
	}

	// An event that no model write produces, recorded with outbox.Publish in
	// the caller's transaction: it commits with the transaction. The
	// idempotency key makes a second Publish of the same reminder a no-op.
	err := db.Transaction(func(tx *gorm.DB) error {
		var o Order
		if err := tx.First(&o, carol.ID).Error; err != nil {
			return err
		}
		return outbox.Publish(tx, outbox.Event{
			Type:           "order.reminder_sent",
			AggregateType:  "order",
			AggregateID:    strconv.FormatUint(uint64(o.ID), 10),
			IdempotencyKey: fmt.Sprintf("order-%d-payment-reminder-1", o.ID),
			Payload:        o,
		})
	})
	if err != nil {
		return Order{}, fmt.Errorf("send reminder: %w", err)
	}

	if err := db.Delete(&dave).Error; err != nil {
		return Order{}, fmt.Errorf("delete order %d: %w", dave.ID, err)
	}

	fmt.Fprintf(out, "wrote 4 orders, 3 status changes, 1 reminder (outbox.Publish), 1 deletion; "+
		"the transaction of order %d (%s) rolled back: %v\n", ghost.ID, ghost.Customer, rollback)
	return ghost, nil
}

// waitForDelivery polls the outbox table until every row is delivered, a
// row is dead-lettered, or limit passes.
func waitForDelivery(ctx context.Context, db *gorm.DB, limit time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var states stateCounts
	for {
		s, err := outboxStates(ctx, db)
		if err != nil && ctx.Err() == nil {
			return err
		}
		if err == nil {
			states = s
			if states[outbox.StateFailed] > 0 {
				return deadLettered(context.WithoutCancel(ctx), db)
			}
			if total := states.total(); total > 0 && states[outbox.StateDelivered] == total {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			if ctx.Err() == context.DeadlineExceeded {
				return fmt.Errorf("not every event was delivered within %v (outbox rows by state: %v)", limit, states)
			}
			return ctx.Err()
		case <-tick.C:
		}
	}
}

// stateCounts counts outbox rows by delivery state.
type stateCounts map[string]int

func (s stateCounts) total() int {
	n := 0
	for _, c := range s {
		n += c
	}
	return n
}

// outboxStates reads how many outbox rows are in each delivery state. The
// library has no call for this; the table is plain SQL.
func outboxStates(ctx context.Context, db *gorm.DB) (stateCounts, error) {
	var rows []struct {
		State string
		N     int
	}
	err := db.WithContext(ctx).Raw(`SELECT delivery_state AS state, count(*) AS n FROM ` +
		outbox.DefaultTable + ` GROUP BY delivery_state`).Scan(&rows).Error
	if err != nil {
		return nil, fmt.Errorf("read outbox state: %w", err)
	}
	s := stateCounts{}
	for _, r := range rows {
		s[r.State] = r.N
	}
	return s, nil
}

// deadLettered describes the first dead-lettered row.
func deadLettered(ctx context.Context, db *gorm.DB) error {
	var row struct {
		EventType   string
		AggregateID string
		LastError   string
	}
	err := db.WithContext(ctx).Raw(`SELECT event_type, aggregate_id, last_error FROM ` + outbox.DefaultTable +
		` WHERE delivery_state = 'failed' ORDER BY id LIMIT 1`).Scan(&row).Error
	if err != nil {
		return fmt.Errorf("read dead-lettered row: %w", err)
	}
	return fmt.Errorf("event %s of order %s was dead-lettered: %s", row.EventType, row.AggregateID, row.LastError)
}

// rowsOfAggregate counts the outbox rows of one aggregate.
func rowsOfAggregate(ctx context.Context, db *gorm.DB, typ string, id uint) (int, error) {
	var n int
	err := db.WithContext(ctx).Raw(`SELECT count(*) FROM `+outbox.DefaultTable+
		` WHERE aggregate_type = ? AND aggregate_id = ?`, typ, strconv.FormatUint(uint64(id), 10)).Scan(&n).Error
	return n, err
}

func stopScheduler(s *outbox.Scheduler) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return s.Stop(ctx)
}

func shutdown(srv *http.Server) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = srv.Shutdown(ctx)
}

// report prints the account and checks it: every outbox row delivered and
// accepted once, every order's events accepted in sequence order, and
// nothing of the rolled-back order anywhere.
func report(out io.Writer, g gatewayRecord, states stateCounts, ghost Order, ghostRows int, elapsed time.Duration) error {
	var problems []string
	written, delivered := states.total(), states[outbox.StateDelivered]

	fmt.Fprintf(out, "\noutbox rows written:  %d\n", written)
	fmt.Fprintf(out, "delivered:            %d of %d, in %.1fs\n", delivered, written, elapsed.Seconds())
	fmt.Fprintf(out, "gateway requests:     %d with a valid signature, %d invalid\n", g.requests, g.invalid)
	if g.invalid > 0 {
		problems = append(problems, fmt.Sprintf("the gateway rejected %d requests as unsigned or malformed", g.invalid))
	}
	refusals := make([]string, len(g.refused))
	refusedEvents := 0
	for i, r := range g.refused {
		refusals[i] = fmt.Sprintf("request %d: %d %s, %d events", r.request, r.status, http.StatusText(r.status), r.events)
		refusedEvents += r.events
	}
	fmt.Fprintf(out, "refused:              %d requests, %d events (%s)\n", len(g.refused), refusedEvents, strings.Join(refusals, "; "))
	fmt.Fprintf(out, "retried:              %d events accepted on a later attempt\n", g.retried)
	fmt.Fprintf(out, "duplicates ignored:   %d\n", g.duplicates)
	if delivered != written || len(g.accepted) != written {
		problems = append(problems, fmt.Sprintf("%d outbox rows, %d delivered, %d accepted by the gateway",
			written, delivered, len(g.accepted)))
	}

	// Per order, in the order the gateway accepted them.
	byOrder := map[string][]accepted{}
	var ids []string
	for _, a := range g.accepted {
		if _, ok := byOrder[a.AggregateID]; !ok {
			ids = append(ids, a.AggregateID)
		}
		byOrder[a.AggregateID] = append(byOrder[a.AggregateID], a)
	}
	sort.Slice(ids, func(i, j int) bool {
		a, _ := strconv.Atoi(ids[i])
		b, _ := strconv.Atoi(ids[j])
		return a < b
	})
	fmt.Fprintf(out, "\nevents accepted per order (aggregate sequence, type, order status):\n")
	for _, id := range ids {
		events := byOrder[id]
		steps := make([]string, len(events))
		for i, a := range events {
			steps[i] = fmt.Sprintf("%d %s [%s]", a.Sequence, a.Type, a.Status)
			if a.Sequence != int64(i+1) {
				problems = append(problems, fmt.Sprintf("order %s: event %d accepted as sequence %d", id, i+1, a.Sequence))
			}
		}
		name := fmt.Sprintf("order %s (%s):", id, events[0].Customer)
		fmt.Fprintf(out, "  %-18s %s\n", name, strings.Join(steps, " → "))
	}

	ghostID := strconv.FormatUint(uint64(ghost.ID), 10)
	seen := 0
	for _, a := range g.accepted {
		if a.AggregateID == ghostID || a.Customer == ghost.Customer {
			seen++
		}
	}
	if seen == 0 && ghostRows == 0 {
		fmt.Fprintf(out, "\nrolled back: order %s (%s) was never seen: no outbox row, no event at the gateway\n", ghostID, ghost.Customer)
	} else {
		fmt.Fprintf(out, "\nrolled back: order %s (%s) LEAKED: %d outbox rows, %d events at the gateway\n", ghostID, ghost.Customer, ghostRows, seen)
		problems = append(problems, fmt.Sprintf("the rolled-back order %s has %d outbox rows and %d delivered events", ghostID, ghostRows, seen))
	}

	if len(problems) > 0 {
		return errors.New(strings.Join(problems, "; "))
	}
	return nil
}

// gateway is the receiving service: the HTTP endpoint the publisher posts
// batches to. It verifies, deduplicates and records, and refuses the first
// and third requests to show the dispatcher retrying.
type gateway struct {
	secret []byte

	mu sync.Mutex
	gatewayRecord
	seen map[string]bool // event IDs accepted
}

// gatewayRecord is what the gateway did.
type gatewayRecord struct {
	requests   int // requests with a valid signature and body
	invalid    int // requests DecodeRequest rejected
	refused    []refusal
	accepted   []accepted // in the order accepted
	retried    int        // events accepted on their second attempt or later
	duplicates int        // events received again after being accepted
}

type refusal struct{ request, status, events int }

type accepted struct {
	Type, AggregateID string
	Sequence          int64
	Customer, Status  string
}

func (g *gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	// DecodeRequest bounds the body, checks the HMAC signature before
	// parsing, and checks the batch against its headers.
	batch, err := outboxhttp.DecodeRequest(r, g.secret, 0)
	if err != nil {
		g.mu.Lock()
		g.invalid++
		g.mu.Unlock()
	}
	switch {
	case errors.Is(err, outboxhttp.ErrBadSignature):
		http.Error(w, "bad signature", http.StatusUnauthorized) // dead-letters the batch
		return
	case errors.Is(err, outboxhttp.ErrTooLarge):
		http.Error(w, "too large", http.StatusRequestEntityTooLarge)
		return
	case err != nil:
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}

	g.mu.Lock()
	defer g.mu.Unlock()
	g.requests++
	switch g.requests {
	case 1: // overloaded: the dispatcher retries after its backoff
		g.refused = append(g.refused, refusal{g.requests, http.StatusServiceUnavailable, len(batch.Messages)})
		http.Error(w, "warming up", http.StatusServiceUnavailable)
		return
	case 3: // rate limited: the retry policy below honours Retry-After
		g.refused = append(g.refused, refusal{g.requests, http.StatusTooManyRequests, len(batch.Messages)})
		w.Header().Set("Retry-After", "1")
		http.Error(w, "slow down", http.StatusTooManyRequests)
		return
	}

	// Check the whole batch before accepting any of it: a 2xx accepts every
	// message, any other answer none.
	orders := make([]Order, len(batch.Messages))
	for i, m := range batch.Messages {
		if err := json.Unmarshal(m.Payload, &orders[i]); err != nil {
			// Can never be accepted: a 4xx other than 408/429 dead-letters it.
			http.Error(w, "event "+m.EventID+": "+err.Error(), http.StatusUnprocessableEntity)
			return
		}
	}
	// Delivery is at least once: skip what was accepted before, and answer
	// 2xx for it again.
	for i, m := range batch.Messages {
		if g.seen[m.EventID] {
			g.duplicates++
			continue
		}
		g.seen[m.EventID] = true
		g.accepted = append(g.accepted, accepted{m.EventType, m.AggregateID, m.Sequence, orders[i].Customer, orders[i].Status})
		if m.Attempt > 1 {
			g.retried++
		}
	}
	w.WriteHeader(http.StatusOK)
}

// snapshot returns a copy of the record.
func (g *gateway) snapshot() gatewayRecord {
	g.mu.Lock()
	defer g.mu.Unlock()
	rec := g.gatewayRecord
	rec.refused = append([]refusal(nil), g.refused...)
	rec.accepted = append([]accepted(nil), g.accepted...)
	return rec
}

// honourRetryAfter wraps a retry policy so that a gateway's Retry-After
// header, which outboxhttp reports in a *StatusError, is waited out when it
// asks for longer than the backoff.
func honourRetryAfter(p outbox.RetryPolicy) outbox.RetryPolicy {
	return outbox.RetryPolicyFunc(func(attempts int, err error) time.Duration {
		wait := p.Backoff(attempts, err)
		var status *outboxhttp.StatusError
		if errors.As(err, &status) && status.RetryAfter > wait {
			wait = status.RetryAfter
		}
		return wait
	})
}

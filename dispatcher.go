package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// Delivery states of an outbox row (the delivery_state column); the
// package documentation draws how a row moves between them.
const (
	StatePending    = "pending"
	StateDelivering = "delivering"
	StateDelivered  = "delivered"
	StateRetry      = "retry"
	StateFailed     = "failed"
)

// Dispatcher defaults, used unless an option says otherwise.
const (
	DefaultBatchSize      = 100
	DefaultLease          = 30 * time.Second
	DefaultPublishTimeout = 10 * time.Second
	DefaultPollInterval   = time.Second
	DefaultMaxAttempts    = 10
	DefaultRetention      = 7 * 24 * time.Hour
	DefaultSweepLimit     = 1000
	maxBatchSize          = 10000
	maxErrorLen           = 2000
)

// Dispatcher moves outbox rows to a [Publisher]: it claims due rows,
// publishes them in batches outside any transaction, and settles each one
// as delivered, to be retried, or failed.
//
// Any number of dispatchers, in any number of processes, may work on one
// table: a claimed row is leased to its dispatcher (delivering, with
// locked_until) and no other dispatcher claims it while the lease lives.
// A dispatcher that dies mid-batch loses nothing: its rows become
// claimable again when the lease passes, so every committed event is
// delivered at least once. Consumers deduplicate on Message.EventID.
//
// Per aggregate, a message is claimed only once the sequence before it has
// been delivered (or is in the same batch, before it), so a publisher never
// receives sequence n+1 before sequence n was accepted. A dead-lettered
// (failed) message therefore holds back the later messages of its own
// aggregate, and of no other, until the retry_failed sweep
// ([Dispatcher.RetryFailed]) or a person ([Dispatcher.Requeue]) brings it
// back and it is delivered, or an operator deletes its row. The later
// messages are parked meanwhile, looked at again once per lease, and made
// due at once when their dead letter comes back. (A message delivered again
// because a publish outlived its lease holds back nothing that was
// accepted after its first delivery.)
//
// A claim takes, of the batch size of oldest due messages, those that
// keep each aggregate's order, so that a batch is what was written
// together (see claim.go). A dispatcher whose claims other dispatchers'
// batches hold back claims from shards of the aggregates instead.
//
// On PostgreSQL, a claim's lease and a settle commit with
// synchronous_commit off, in their own transactions only: they do not wait
// for their WAL to reach the disk, or a synchronous standby. A crash of the
// server can forget the last of them (up to three times wal_writer_delay,
// 600ms by default; after a failover, those the standby had not received).
// A forgotten settle leaves its rows leased, to be delivered again when the
// lease passes; a forgotten lease makes its rows due again while their
// dispatcher may still be publishing them, so that another dispatcher may
// publish the same events at the same time. Either way an event is
// delivered again, never lost, and never handed out before the events of
// its aggregate before it were accepted once (the log is replayed in
// order, so a lease that survives was taken after the settles before it);
// consumers see the redelivered events again, in order, after newer ones.
// The events themselves are written by the caller's transaction, as
// durably as it commits.
//
// The table name is taken from the outbox plugin registered on the
// *gorm.DB, or [DefaultTable] when none is. A Dispatcher is safe for
// concurrent use.
type Dispatcher struct {
	db  *gorm.DB
	pub Publisher
	d   dialect.Dialect
	t   dialect.Tables
	st  dialect.Statements

	batchSize      int
	lease          time.Duration
	publishTimeout time.Duration
	pollInterval   time.Duration
	retry          RetryPolicy
	maxAttempts    int
	retention      time.Duration
	sweepLimit     int
	log            *slog.Logger
	listen         bool
	maxRevivals    int

	wake      chan struct{}
	inProcess atomic.Bool  // Run is woken by in-process writes
	lastPark  atomic.Int64 // unix nanoseconds of the last parkBlocked
	shard     atomic.Int32 // 0: claims read every aggregate; s > 0: shard s-1 only (ClaimShard, WindowShard)
	shardRun  atomic.Int32 // full claims in a row from the current shard
}

// DispatcherOption configures a [Dispatcher]; see [NewDispatcher].
type DispatcherOption func(*Dispatcher) error

// WithBatchSize sets how many rows one claim takes at most (default
// [DefaultBatchSize], 1 to 10,000).
func WithBatchSize(n int) DispatcherOption {
	return func(d *Dispatcher) error {
		if n < 1 || n > maxBatchSize {
			return fmt.Errorf("%w: WithBatchSize: %d is not between 1 and %d", ErrInvalidOption, n, maxBatchSize)
		}
		d.batchSize = n
		return nil
	}
}

// WithLease sets how long a claimed row stays leased to its dispatcher
// (default [DefaultLease]). It must exceed the publish timeout: a batch
// still publishing when its lease ends may be claimed, and delivered,
// again. A lease forgotten by a crash of the PostgreSQL server ends early
// (see [Dispatcher]).
func WithLease(lease time.Duration) DispatcherOption {
	return func(d *Dispatcher) error {
		if lease < 10*time.Millisecond {
			return fmt.Errorf("%w: WithLease: %v is shorter than 10ms", ErrInvalidOption, lease)
		}
		d.lease = lease
		return nil
	}
}

// WithPublishTimeout sets the deadline of one Publish call (default
// [DefaultPublishTimeout]); it must be shorter than the lease. A publisher
// that ignores its context is abandoned at the deadline and its batch is
// retried.
func WithPublishTimeout(timeout time.Duration) DispatcherOption {
	return func(d *Dispatcher) error {
		if timeout <= 0 {
			return fmt.Errorf("%w: WithPublishTimeout: %v is not positive", ErrInvalidOption, timeout)
		}
		d.publishTimeout = timeout
		return nil
	}
}

// WithPollInterval sets how often [Dispatcher.Run] looks for due rows when
// it has not been woken (default [DefaultPollInterval]). A message that a
// publisher reported as not attempted is due again after it.
func WithPollInterval(interval time.Duration) DispatcherOption {
	return func(d *Dispatcher) error {
		if interval <= 0 {
			return fmt.Errorf("%w: WithPollInterval: %v is not positive", ErrInvalidOption, interval)
		}
		d.pollInterval = interval
		return nil
	}
}

// WithRetryPolicy sets when failed messages are tried again (default
// [DefaultRetryPolicy]).
func WithRetryPolicy(p RetryPolicy) DispatcherOption {
	return func(d *Dispatcher) error {
		if p == nil {
			return fmt.Errorf("%w: WithRetryPolicy: nil policy", ErrInvalidOption)
		}
		d.retry = p
		return nil
	}
}

// WithMaxAttempts sets after how many failed attempts a message is
// dead-lettered (default [DefaultMaxAttempts], at least 1).
func WithMaxAttempts(n int) DispatcherOption {
	return func(d *Dispatcher) error {
		if n < 1 {
			return fmt.Errorf("%w: WithMaxAttempts: %d is less than 1", ErrInvalidOption, n)
		}
		d.maxAttempts = n
		return nil
	}
}

// WithRetention sets how long delivered rows are kept before
// [Dispatcher.Cleanup] deletes them (default [DefaultRetention]). An
// idempotency key protects against duplicates only while its row exists.
func WithRetention(retention time.Duration) DispatcherOption {
	return func(d *Dispatcher) error {
		if retention <= 0 {
			return fmt.Errorf("%w: WithRetention: %v is not positive", ErrInvalidOption, retention)
		}
		d.retention = retention
		return nil
	}
}

// WithSweepLimit bounds how many rows one call of [Dispatcher.RetryFailed]
// moves, and how many one cleanup statement deletes (default
// [DefaultSweepLimit]).
func WithSweepLimit(n int) DispatcherOption {
	return func(d *Dispatcher) error {
		if n < 1 {
			return fmt.Errorf("%w: WithSweepLimit: %d is less than 1", ErrInvalidOption, n)
		}
		d.sweepLimit = n
		return nil
	}
}

// WithLogger sets the logger (default slog.Default() at construction).
func WithLogger(l *slog.Logger) DispatcherOption {
	return func(d *Dispatcher) error {
		if l == nil {
			return fmt.Errorf("%w: WithLogger: nil logger", ErrInvalidOption)
		}
		d.log = l
		return nil
	}
}

// NewDispatcher returns a dispatcher that delivers the outbox rows of db to
// p. db must not be inside a transaction, and on MySQL (MariaDB) its DSN
// must have parseTime=true. It validates every option; an invalid one
// yields an error wrapping [ErrInvalidOption] that names it.
//
// It then reads the schema versions of the outbox table (one query): on a
// database without the outbox tables, or whose tables lack a version this
// library needs, it fails with an error wrapping [ErrSchemaNotCurrent]
// that names [AutoMigrate]; on a database that does not answer within 10
// seconds, with that error. Call AutoMigrate (or apply [Migrations]) before NewDispatcher.
// Last, like db.Use of the plugin, it logs one warning for each database
// setting the documentation says matters that the database runs without
// (see [OutboxPlugin.Initialize]; here through [WithLogger]), and never
// fails on them.
func NewDispatcher(db *gorm.DB, p Publisher, opts ...DispatcherOption) (*Dispatcher, error) {
	if db == nil {
		return nil, fmt.Errorf("%w: NewDispatcher: nil *gorm.DB", ErrInvalidOption)
	}
	if p == nil {
		return nil, fmt.Errorf("%w: NewDispatcher: nil Publisher", ErrInvalidOption)
	}
	if _, inTx := db.Statement.ConnPool.(gorm.TxCommitter); inTx {
		return nil, fmt.Errorf("%w: NewDispatcher: db is inside a transaction; a dispatcher commits each of its statements on its own", ErrInvalidOption)
	}
	dl, err := dialect.For(db)
	if err != nil {
		return nil, fmt.Errorf("%w: NewDispatcher: %w", ErrInvalidOption, err)
	}
	if err := dl.CheckPool(db); err != nil {
		return nil, fmt.Errorf("%w: NewDispatcher: %w", ErrInvalidOption, err)
	}
	if err := checkConn(db, dl); err != nil {
		return nil, err
	}
	d := &Dispatcher{
		db:             db,
		pub:            p,
		d:              dl,
		batchSize:      DefaultBatchSize,
		lease:          DefaultLease,
		publishTimeout: DefaultPublishTimeout,
		pollInterval:   DefaultPollInterval,
		retry:          DefaultRetryPolicy(),
		maxAttempts:    DefaultMaxAttempts,
		retention:      DefaultRetention,
		sweepLimit:     DefaultSweepLimit,
		log:            slog.Default(),
		listen:         true,
		maxRevivals:    DefaultMaxRevivals,
		wake:           make(chan struct{}, 1),
	}
	d.t = dl.Tables(tableNameOf(db))
	d.st = dl.Statements(d.t)
	for _, opt := range opts {
		if err := opt(d); err != nil {
			return nil, err
		}
	}
	if d.publishTimeout >= d.lease {
		return nil, fmt.Errorf("%w: WithPublishTimeout: %v must be shorter than the lease (%v)", ErrInvalidOption, d.publishTimeout, d.lease)
	}
	ctx, cancel := context.WithTimeout(context.Background(), schemaCheckTimeout)
	defer cancel()
	if err := schemaCurrent(ctx, db, dl, d.t); err != nil {
		return nil, err
	}
	warnSettings(context.Background(), db, dl, d.t, d.log)
	return d, nil
}

// pool is what the dispatcher's statements outside a claim run on.
func (d *Dispatcher) pool() gorm.ConnPool { return d.db.Statement.ConnPool }

// DispatchOnce runs one round: it claims up to the batch size of due rows,
// publishes them as one batch, and settles each row. It returns how many
// messages were delivered. A settle that finds its lease taken over by
// another dispatcher leaves that row alone.
//
// A round whose ctx ends (cancelled, or past its deadline) before its
// publisher has accepted the whole batch is not a delivery attempt,
// whatever error the publisher returns: the publish is abandoned (a
// publisher should return when its context ends), the messages it did not
// accept go back as they were (due again at once, their attempts
// unchanged, so that a new message's next delivery is attempt 1), and
// DispatchOnce returns the count of those it accepted with an error
// wrapping ctx.Err(). A batch accepted whole is delivered, with no error.
// The settle always runs to completion, on a context that is not
// cancelled. A publish that outlives the publish timeout, by contrast, is
// a failed attempt. [Dispatcher.Run] and the [Scheduler] never cancel a
// publish: when they stop, the batch in flight is published and settled
// first.
// [Dispatcher.Dispatch] says more about the round, for a drain loop of
// your own.
func (d *Dispatcher) DispatchOnce(ctx context.Context) (int, error) {
	r, err := d.Dispatch(ctx)
	return r.Delivered, err
}

// DispatchResult is what one round of [Dispatcher.Dispatch] did.
type DispatchResult struct {
	// Claimed is how many rows the round claimed and settled; Delivered,
	// how many of them were accepted and marked delivered.
	Claimed, Delivered int
	// More reports that due rows may remain that this round had no room
	// for (its batch was full, or it took rows from a window of due rows
	// that was full), or that parking released rows that held its claim
	// back: a drain loop calls Dispatch again at once while More is true,
	// and otherwise waits for a wake-up or its poll interval.
	More bool
}

// Dispatch is [Dispatcher.DispatchOnce] with the round's whole result:
//
//	for {
//		r, err := d.Dispatch(ctx)
//		if err != nil || !r.More {
//			break // or wait, and go on
//		}
//	}
func (d *Dispatcher) Dispatch(ctx context.Context) (r DispatchResult, err error) {
	c, err := d.claim(ctx)
	if err != nil {
		return DispatchResult{}, err
	}
	if c.blocked && len(c.rows) < d.batchSize {
		// After the settle, so that a batch it holds is never stranded.
		defer func() {
			if d.parkBlocked(context.WithoutCancel(ctx)) && err == nil {
				r.More = true // the next claim's window may reach rows it can take
			}
		}()
	}
	if len(c.rows) == 0 {
		return DispatchResult{}, nil
	}
	batch := Batch{ID: c.batchID, Messages: make([]Message, 0, len(c.rows))}
	held := unreadable(c.rows)
	for _, row := range c.rows {
		if !held.withholds(row) {
			batch.Messages = append(batch.Messages, row.msg)
		}
	}
	var pubErr error
	switch {
	case len(batch.Messages) == 0:
	case ctx.Err() != nil: // ended after the claim: not published
		pubErr = ctx.Err()
	default:
		pubErr = d.publish(ctx, batch)
	}
	cancelled := pubErr != nil && ctx.Err() != nil
	if cancelled {
		pubErr = &cancelledError{pubErr}
	}
	delivered, err := d.settle(context.WithoutCancel(ctx), batch.ID, c.rows, pubErr)
	if err == nil && cancelled {
		err = fmt.Errorf("outbox: dispatch of batch %s cancelled; the messages not accepted are due again: %w", batch.ID, ctx.Err())
	}
	return DispatchResult{Claimed: len(c.rows), Delivered: delivered, More: c.more}, err
}

// cancelledError is the publish error of a round whose context ended
// before its publisher accepted the whole batch. The publisher failed, or
// was never called, because the caller stopped the round, not because
// delivery failed: the messages it did not accept are put back as not
// attempted and are due again at once (see [Dispatcher.settle]).
type cancelledError struct{ err error }

func (e *cancelledError) Error() string { return "dispatch cancelled: " + e.err.Error() }
func (e *cancelledError) Unwrap() error { return e.err }

// unreadableSeqs maps each aggregate of a batch that has a row that cannot
// be read to the lowest sequence of such a row. It is nil for a batch
// whose rows were all read, which is the normal case.
type unreadableSeqs map[dialect.Aggregate]int64

// unreadable returns the unreadable rows of a batch by aggregate.
func unreadable(rows []claimed) unreadableSeqs {
	var u unreadableSeqs
	for _, r := range rows {
		if r.bad == nil {
			continue
		}
		if u == nil {
			u = unreadableSeqs{}
		}
		k := dialect.Aggregate{Type: r.msg.AggregateType, ID: r.msg.AggregateID}
		if seq, ok := u[k]; !ok || r.msg.Sequence < seq {
			u[k] = r.msg.Sequence
		}
	}
	return u
}

// withholds reports whether r stays out of the published batch: it cannot
// be read, or it comes after a row of its aggregate that cannot.
func (u unreadableSeqs) withholds(r claimed) bool {
	seq, ok := u[dialect.Aggregate{Type: r.msg.AggregateType, ID: r.msg.AggregateID}]
	return ok && r.msg.Sequence >= seq
}

// ErrPublisherPanic is wrapped by the error a batch is retried with when
// its publisher panicked; the panic is recovered and logged.
var ErrPublisherPanic = errors.New("outbox: publisher panicked")

// publish calls the publisher under the publish deadline. A panic becomes
// an error; a publisher that ignores its context is abandoned at the
// deadline.
func (d *Dispatcher) publish(ctx context.Context, b Batch) error {
	pctx, cancel := context.WithTimeout(ctx, d.publishTimeout)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		defer func() {
			if r := recover(); r != nil {
				d.log.Error("outbox: publisher panicked; the batch will be retried", "batch_id", b.ID, "panic", r)
				done <- fmt.Errorf("%w: %v", ErrPublisherPanic, r)
			}
		}()
		done <- d.pub.Publish(pctx, b)
	}()
	select {
	case err := <-done:
		return err
	case <-pctx.Done():
		// Give a well-behaved publisher a moment to return its own error.
		select {
		case err := <-done:
			return err
		case <-time.After(100 * time.Millisecond):
			d.log.Error("outbox: publisher ignored the end of its context; abandoning it, the batch will be retried", "batch_id", b.ID)
			return fmt.Errorf("outbox: publish: %w", pctx.Err())
		}
	}
}

// Table returns the name of the outbox table the dispatcher works on, as
// configured (unquoted).
func (d *Dispatcher) Table() string { return d.t.Name }

// DB returns the database the dispatcher was made with.
func (d *Dispatcher) DB() *gorm.DB { return d.db }

// SweepLimit returns how many rows one sweep, requeue or cleanup
// statement moves at most ([WithSweepLimit], default [DefaultSweepLimit]).
func (d *Dispatcher) SweepLimit() int { return d.sweepLimit }

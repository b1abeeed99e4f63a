package inbox

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strings"
	"time"
	"unicode/utf8"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
)

// DefaultTable is the name of the inbox table unless [WithTable] says
// otherwise. Its schema version is kept beside it, in the table named
// DefaultTable + "_schema".
const DefaultTable = "inbox_records"

// DefaultCleanupBatch is how many rows one statement of [Inbox.Cleanup]
// deletes at most unless [WithCleanupBatch] says otherwise.
const DefaultCleanupBatch = 1000

// MaxIDLength is the longest message id, and message type, the inbox
// records, in characters (Unicode code points): the outbox's own limits
// ([outbox.MaxEventIDLength], [outbox.MaxEventTypeLength]), so every event
// the outbox delivers fits. 255 is what a VARCHAR(255) primary key holds
// on MySQL and MariaDB (1,020 bytes in utf8mb4, within InnoDB's key
// limit), and the inbox checks it on every engine, so that an id accepted
// on one engine is accepted on every engine. The outbox's generated ids,
// UUIDv7s, have 36.
const MaxIDLength = 255

var (
	// ErrInvalidMessage is returned (wrapped, with the reason) by
	// [Inbox.Handle] and [Inbox.HandleMessage] for a message id, or type,
	// that cannot be recorded: an empty id, one longer than [MaxIDLength]
	// characters, invalid UTF-8, or a NUL character. Nothing is recorded
	// and fn is not called; delivering the same message again fails the
	// same way.
	ErrInvalidMessage = errors.New("inbox: invalid message")

	// ErrSchemaTooNew is returned (wrapped) by [Inbox.Migrate] when the
	// table's recorded schema version is newer than this version of the
	// package knows: a newer release migrated it. Nothing is changed.
	ErrSchemaTooNew = errors.New("inbox: schema is newer than this package")
)

// identifierRE accepts the table names the outbox's own WithTable
// accepts: plain identifiers short enough that every name derived from
// them fits PostgreSQL's 63 bytes and MySQL's 64 characters.
var identifierRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,42}$`)

// Inbox records the ids of the messages a consumer has applied, in the
// consumer's own database, so that each message is applied once however
// often it is delivered. Create one with [New]; it is safe for concurrent
// use by any number of goroutines and processes.
type Inbox struct {
	db           *gorm.DB
	d            dialect
	t            tables
	cleanupBatch int
}

// Option configures an [Inbox]. An option given an invalid value makes
// [New] fail with an error that wraps [outbox.ErrInvalidOption] and names
// the option.
type Option func(*config) error

type config struct {
	table        string
	cleanupBatch int
}

// WithTable sets the name of the inbox table (default [DefaultTable]). The
// name must be a plain identifier, as for the outbox's table: a letter or
// underscore, then letters, digits or underscores, 43 characters at most,
// not starting with "sqlite_". It is used quoted, so its case is kept.
// Consumers that must not share their deduplication (two services in one
// database) use a table each.
func WithTable(name string) Option {
	return func(c *config) error {
		if !identifierRE.MatchString(name) {
			return fmt.Errorf("%w: WithTable: %q is not a plain identifier of at most 43 characters ([A-Za-z_][A-Za-z0-9_]*)", outbox.ErrInvalidOption, name)
		}
		if strings.HasPrefix(strings.ToLower(name), "sqlite_") {
			return fmt.Errorf("%w: WithTable: %q starts with sqlite_, which SQLite reserves", outbox.ErrInvalidOption, name)
		}
		c.table = name
		return nil
	}
}

// WithCleanupBatch sets how many rows one statement of [Inbox.Cleanup]
// deletes at most, each in a transaction of its own, so that forgetting a
// large backlog never holds long locks (default [DefaultCleanupBatch], 1
// to 100,000).
func WithCleanupBatch(n int) Option {
	return func(c *config) error {
		if n < 1 || n > 100_000 {
			return fmt.Errorf("%w: WithCleanupBatch: %d is not between 1 and 100000", outbox.ErrInvalidOption, n)
		}
		c.cleanupBatch = n
		return nil
	}
}

// New returns the inbox kept in db's database. db is the consumer's
// connection pool, not a transaction: [Inbox.Handle] opens a transaction
// of its own for every message. The engine must be PostgreSQL, SQLite or
// MySQL/MariaDB; on SQLite, open db with a busy timeout so that
// concurrent deliveries wait for each other instead of failing (WAL and
// _txlock=immediate are recommended, as for the outbox). New validates
// every option; an invalid one, a nil db or another engine yields an error
// wrapping [outbox.ErrInvalidOption]. New does not touch the database;
// call [Inbox.Migrate] before the first Handle.
func New(db *gorm.DB, opts ...Option) (*Inbox, error) {
	if db == nil {
		return nil, fmt.Errorf("%w: inbox.New: nil *gorm.DB", outbox.ErrInvalidOption)
	}
	if _, inTx := db.Statement.ConnPool.(gorm.TxCommitter); inTx {
		return nil, fmt.Errorf("%w: inbox.New: db is inside a transaction; Handle opens a transaction of its own per message", outbox.ErrInvalidOption)
	}
	d, err := dialectOf(db)
	if err != nil {
		return nil, err
	}
	c := config{table: DefaultTable, cleanupBatch: DefaultCleanupBatch}
	for _, opt := range opts {
		if err := opt(&c); err != nil {
			return nil, err
		}
	}
	return &Inbox{db: db, d: d, t: tablesFor(d, c.table), cleanupBatch: c.cleanupBatch}, nil
}

// Table returns the name of the inbox table, as configured.
func (in *Inbox) Table() string { return in.t.name }

// errDuplicate rolls back the transaction of a delivery whose id was
// already recorded.
var errDuplicate = errors.New("inbox: already handled")

// Handle applies the message messageID once: it runs fn in a transaction
// that also records messageID, and commits both or neither.
//
//   - When messageID was recorded before (the message was applied), fn is
//     not called and Handle returns false, nil.
//   - When fn returns an error (or panics), the transaction rolls back,
//     nothing is recorded, and Handle returns false and the error: a
//     later delivery applies the message again.
//   - Otherwise the transaction commits and Handle returns true, nil, or
//     false and the commit's error (when the connection failed during the
//     commit, the message may have been applied; a redelivery finds out).
//
// The id is recorded first, so a concurrent delivery of the same id (a
// redelivery racing the first attempt, a second consumer) waits for the
// first's transaction and then sees the id handled, or, if the first
// rolled back, applies the message itself: fn commits once. fn must do
// all its writes through tx, the transaction's handle; events it records
// through the outbox plugin on tx commit with them. fn should not keep
// the transaction open for long: concurrent deliveries of the same id
// wait for it (and, on SQLite, every other writer of the database).
//
// messageID is the message's unique id, for an outbox message its
// EventID; one that cannot be recorded yields [ErrInvalidMessage]. The
// transaction uses ctx. fn's error comes back unchanged; Handle's own
// errors name the operation and the id.
func (in *Inbox) Handle(ctx context.Context, messageID string, fn func(tx *gorm.DB) error) (bool, error) {
	return in.handle(ctx, messageID, nil, fn)
}

// HandleMessage is [Inbox.Handle] for an outbox message: it records
// m.EventID, and m.EventType as the row's message type.
func (in *Inbox) HandleMessage(ctx context.Context, m outbox.Message, fn func(tx *gorm.DB) error) (bool, error) {
	typ := m.EventType
	return in.handle(ctx, m.EventID, &typ, fn)
}

func (in *Inbox) handle(ctx context.Context, id string, typ *string, fn func(tx *gorm.DB) error) (bool, error) {
	if fn == nil {
		return false, fmt.Errorf("inbox: handle %q: fn is nil", truncate(id))
	}
	if err := checkText("id", id); err != nil {
		return false, err
	}
	if typ != nil {
		if *typ == "" {
			typ = nil
		} else if err := checkText("type", *typ); err != nil {
			return false, err
		}
	}
	for attempt := 1; ; attempt++ {
		handled, err := in.attempt(ctx, id, typ, fn)
		var retry *retryError
		if !errors.As(err, &retry) {
			return handled, err
		}
		if attempt == maxInsertAttempts {
			return false, fmt.Errorf("inbox: handle %q: record id: %w", id, retry.err)
		}
		// A deadlock among deliveries that waited for one that rolled back:
		// nothing has run yet, so the delivery starts again, after a pause
		// that keeps the survivors apart.
		select {
		case <-ctx.Done():
			return false, fmt.Errorf("inbox: handle %q: record id: %w", id, retry.err)
		case <-time.After(time.Duration(attempt) * time.Duration(1+rand.IntN(5)) * time.Millisecond):
		}
	}
}

// maxInsertAttempts bounds how often Handle starts a delivery again whose
// insert of the id failed without the id being recorded (see retryError).
const maxInsertAttempts = 5

// retryError is what dialect.insert returns when the insert of the id
// failed, the id is not recorded, and the transaction may have been rolled
// back under it (a deadlock): Handle runs the delivery again.
type retryError struct{ err error }

func (e *retryError) Error() string { return e.err.Error() }

// attempt runs one transaction of handle.
func (in *Inbox) attempt(ctx context.Context, id string, typ *string, fn func(tx *gorm.DB) error) (bool, error) {
	var fnErr, recordErr error
	err := in.db.WithContext(ctx).Transaction(func(tx *gorm.DB) error {
		inserted, err := in.d.insert(tx, in.t, id, typ, time.Now())
		var retry *retryError
		switch {
		case errors.As(err, &retry):
			recordErr = err
			return err
		case err != nil:
			recordErr = fmt.Errorf("inbox: handle %q: record id: %w", id, err)
			return recordErr
		case !inserted:
			return errDuplicate
		}
		fnErr = fn(tx)
		return fnErr
	})
	switch {
	case err == nil:
		return true, nil
	case errors.Is(err, errDuplicate):
		return false, nil
	case fnErr != nil:
		return false, fnErr
	case recordErr != nil:
		return false, recordErr
	}
	return false, fmt.Errorf("inbox: handle %q: %w", id, err)
}

// checkText validates a message id or type for storage on every engine.
func checkText(what, s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%w: %s is empty", ErrInvalidMessage, what)
	case !utf8.ValidString(s):
		return fmt.Errorf("%w: %s %q is not valid UTF-8", ErrInvalidMessage, what, truncate(s))
	case strings.IndexByte(s, 0) >= 0:
		return fmt.Errorf("%w: %s %q contains a NUL character", ErrInvalidMessage, what, truncate(s))
	case utf8.RuneCountInString(s) > MaxIDLength:
		return fmt.Errorf("%w: %s %q... has %d characters, more than %d", ErrInvalidMessage, what, truncate(s), utf8.RuneCountInString(s), MaxIDLength)
	}
	return nil
}

// truncate keeps an error message short whatever the input.
func truncate(s string) string {
	const keep = 40
	if len(s) <= keep {
		return s
	}
	cut := keep
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

// Cleanup forgets the ids recorded more than age ago and returns how many
// it deleted. It deletes in statements of at most the cleanup batch size
// (see [WithCleanupBatch]), each committed on its own, until none is
// left or ctx ends; on an error it returns what it deleted so far.
//
// A message delivered again after its id was forgotten is applied again:
// keep ids for longer than any delivery can be late (the outbox retries an
// event until its attempts are spent, and a requeue of dead-lettered
// events delivers them again however old they are). age must be positive.
func (in *Inbox) Cleanup(ctx context.Context, age time.Duration) (int, error) {
	if age <= 0 {
		return 0, fmt.Errorf("inbox: cleanup: age %v is not positive", age)
	}
	cutoff := in.d.timeArg(time.Now().Add(-age))
	db := in.db.WithContext(ctx)
	total := 0
	for {
		res := db.Exec(in.d.cleanupSQL(in.t), cutoff, in.cleanupBatch)
		if res.Error != nil {
			return total, fmt.Errorf("inbox: cleanup: %w", res.Error)
		}
		total += int(res.RowsAffected)
		if int(res.RowsAffected) < in.cleanupBatch || ctx.Err() != nil {
			return total, nil
		}
	}
}

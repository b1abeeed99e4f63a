package outbox

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"maps"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// DefaultTable is the name of the outbox table unless [WithTable] says
// otherwise. The per-aggregate sequence state lives beside it, in the table
// named DefaultTable + "_sequences".
const DefaultTable = "outbox_records"

const pluginName = "outbox"

// OutboxPlugin is a gorm.Plugin that records outbox events in the
// transaction of the business write they describe. Create one with
// [Plugin] and register it with db.Use.
//
// Once registered, every Create, Update, Save and Delete of a model that
// emits events (an [Emitter], or a type given to [RegisterEmitter]) writes
// the model's events to the outbox table through the same connection and
// transaction. The outbox rows commit if and only if the business write
// commits: inside db.Transaction, inside GORM's default per-statement
// transaction, inside savepoints, and with SkipDefaultTransaction, where the
// plugin opens a transaction of its own for statements on emitting models.
//
// Events describe what the database did. The plugin runs GORM's statement
// with RETURNING and asks the emitter once per row the statement actually
// inserted, updated or deleted, with the model filled from that row as
// stored (defaults, expressions and triggers included), so a row the
// statement did not write gets no event. An upsert reports each row as
// created or updated by what happened to it. Writes by condition
// (Where(...).Update, Delete by primary key value, GORM's association
// statements, gorm.G[T]) and creates from maps record an event per row
// written. Dry runs and ToSQL record nothing; so do writes the plugin
// cannot see: SQL through Exec or Raw, writes through Table(...) without
// a model, and rows the database changes by itself (ON DELETE CASCADE,
// triggers). A write that fails leaves
// neither its rows nor its events behind, even when the caller ignores the
// error and commits its transaction: on SQLite and MySQL each write in the
// caller's transaction runs inside a savepoint of its own, which a write
// inside it (an association, a hook's write) nests in; on PostgreSQL a
// failure after the rows were written aborts the transaction.
//
// An OutboxPlugin is safe for concurrent use.
type OutboxPlugin struct {
	tables dialect.Tables
	notify bool
	log    *slog.Logger // WithPluginLogger
	err    error        // an invalid option, reported by Initialize

	contextHeaders []contextHeadersFunc // WithContextHeaders
	maxPayload     int                  // WithMaxPayloadBytes; 0: DefaultMaxPayloadBytes

	mu        sync.RWMutex
	emitters  map[reflect.Type]func(model any, op Op) ([]Event, error)
	wakers    map[*func()]struct{}
	notifiers map[*sql.DB]*notifier

	ownInFlight atomic.Int64  // transactions whose commit the plugin sees, counted in flight (see wake.go)
	savepoints  atomic.Uint64 // savepoints set, which numbers their names (see savepoint)
}

// Option configures a [Plugin].
type Option func(*OutboxPlugin) error

// identifierRE accepts plain SQL identifiers short enough that every name
// derived from them (the longest is <name>_idempotency_key_key) fits
// PostgreSQL's 63 bytes.
var identifierRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,42}$`)

// WithTable sets the name of the outbox table (default [DefaultTable]).
// The name must be a plain identifier: a letter or underscore, then
// letters, digits or underscores, 43 characters at most, not starting with
// "sqlite_" (reserved by SQLite). It is used quoted, so its case is kept. A
// dispatcher uses the table of the plugin registered on its *gorm.DB.
func WithTable(name string) Option {
	return func(p *OutboxPlugin) error {
		if err := validateTable(name); err != nil {
			return err
		}
		p.tables = dialect.TablesFor(name)
		return nil
	}
}

// WithNotify sets whether writes of events send a PostgreSQL notification
// on the channel named like the table, so that a listening [Dispatcher.Run]
// dispatches as soon as they commit (default true). A notification never
// comes before its events are committed; one may follow a write that was
// rolled back after its events were written, and wakes the dispatchers for
// nothing. A transaction notifies at its own commit when it runs in the
// caller's db.Transaction (whose commit the plugin cannot see) or is alone;
// when several whose commits the plugin sees overlap (GORM's per-statement
// transactions, [Transaction], Publish outside a transaction), a notifier sends one
// notification for them after their commits, at most one per 5 ms, from a
// connection of the pool, so that they are not made to commit one at a
// time. It has no effect on SQLite.
func WithNotify(enabled bool) Option {
	return func(p *OutboxPlugin) error {
		p.notify = enabled
		return nil
	}
}

func validateTable(name string) error {
	if !identifierRE.MatchString(name) {
		return fmt.Errorf("%w: WithTable: %q is not a plain identifier of at most 43 characters ([A-Za-z_][A-Za-z0-9_]*)", ErrInvalidOption, name)
	}
	if strings.HasPrefix(strings.ToLower(name), "sqlite_") {
		return fmt.Errorf("%w: WithTable: %q starts with sqlite_, which SQLite reserves", ErrInvalidOption, name)
	}
	return nil
}

// Plugin returns the outbox plugin, to be registered with db.Use. An
// invalid option makes db.Use fail with an error wrapping
// [ErrInvalidOption]; so does an engine other than PostgreSQL, MySQL
// (MariaDB) or SQLite, and a MySQL DSN without parseTime=true.
func Plugin(opts ...Option) *OutboxPlugin {
	p := &OutboxPlugin{
		tables:   dialect.TablesFor(DefaultTable),
		notify:   true,
		log:      slog.Default(),
		emitters: make(map[reflect.Type]func(any, Op) ([]Event, error)),
		wakers:   make(map[*func()]struct{}),

		notifiers: make(map[*sql.DB]*notifier),
	}
	for _, opt := range opts {
		if err := opt(p); err != nil && p.err == nil {
			p.err = err
		}
	}
	return p
}

// Name returns "outbox", the key under which GORM keeps the plugin.
func (p *OutboxPlugin) Name() string { return pluginName }

// Initialize registers the plugin's callbacks on db. GORM calls it from
// db.Use. It logs one warning (see [WithPluginLogger]) for each setting
// the documentation says matters that the database runs without: on
// SQLite, the WAL journal mode and a busy timeout (a file database opened
// without them fails concurrent writes with "database is locked"); on
// PostgreSQL, autovacuum. These checks cost a query or two, and never make
// db.Use fail. On MySQL (MariaDB) it also asks the server one query to
// check parseTime=true, and fails when the DSN lacks it, or with the
// server's error when the server does not answer within 5 seconds.
func (p *OutboxPlugin) Initialize(db *gorm.DB) error {
	if p.err != nil {
		return p.err
	}
	dl, err := dialect.For(db)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidOption, err)
	}
	if err := checkConn(db, dl); err != nil {
		return err
	}
	warnSettings(context.Background(), db, dl, dl.Tables(p.tables.Name), p.log)
	return p.registerCallbacks(db)
}

// Table returns the name of the outbox table the plugin writes to.
func (p *OutboxPlugin) Table() string { return p.tables.Name }

// RegisterEmitter attaches events to a model type T that cannot implement
// [Emitter] itself, for example a type from another package. After every
// create, update and delete of a T, the plugin calls fn once per row
// written, with the model filled from the row as stored, and records the
// events it returns, exactly as for an Emitter.
//
// It fails if T is not a struct type, already has an emitter registered, or
// implements Emitter itself. It may be called before or after db.Use; a
// write that starts after it returns sees the registration.
func RegisterEmitter[T any](p *OutboxPlugin, fn func(model *T, op Op) ([]Event, error)) error {
	t := reflect.TypeFor[T]()
	switch {
	case fn == nil:
		return fmt.Errorf("%w: RegisterEmitter[%s]: nil function", ErrInvalidOption, t)
	case t.Kind() != reflect.Struct:
		return fmt.Errorf("%w: RegisterEmitter[%s]: not a struct type", ErrInvalidOption, t)
	case reflect.PointerTo(t).Implements(emitterType):
		return fmt.Errorf("%w: RegisterEmitter[%s]: the type implements Emitter already", ErrInvalidOption, t)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, dup := p.emitters[t]; dup {
		return fmt.Errorf("%w: RegisterEmitter[%s]: registered twice", ErrInvalidOption, t)
	}
	p.emitters[t] = func(model any, op Op) ([]Event, error) { return fn(model.(*T), op) }
	return nil
}

var emitterType = reflect.TypeFor[Emitter]()

// emitterFor returns how to get the events of a model of type t (a struct
// type), or nil when t does not emit.
func (p *OutboxPlugin) emitterFor(t reflect.Type) func(model any, op Op) ([]Event, error) {
	if reflect.PointerTo(t).Implements(emitterType) {
		return func(model any, op Op) ([]Event, error) { return model.(Emitter).OutboxEvents(op) }
	}
	p.mu.RLock()
	defer p.mu.RUnlock()
	return p.emitters[t]
}

// WithoutEvents returns db set up so that the statements run through it
// record no outbox events, even on models that emit them. Use it for
// backfills and data repairs, and for the writes the plugin refuses (see
// [ErrUnidentifiedRows]); [Publish] still records what it is given.
//
// That holds for every statement of the sessions GORM derives from the
// returned db, new ones included: the saves of associations, the writes
// of the models' hooks, db.Transaction's tx and gorm.G[T](db)'s
// statements. The result is a session: it may be kept and used for
// statement after statement. It leaves db itself as it was, even where db
// is a chain whose statements GORM runs on one Statement (db.Model(&x),
// say).
func WithoutEvents(db *gorm.DB) *gorm.DB {
	// Scopes() adds nothing; it returns db itself only for a chain, and
	// otherwise the statement GORM would give db's next call: a fresh one
	// for a new session (the tx of a hook), a copy for others. A session
	// of it hands each call made through the result a copy of that
	// statement, so that the result serves statement after statement.
	tx := db.Scopes().Session(&gorm.Session{})
	// The mark goes in the configuration, which every session GORM
	// derives copies (Session, Begin, a hook's tx, gorm.G's Session with
	// NewDB and the call's context), where a statement's settings are
	// dropped by a new session. The copy keeps db's own as it was.
	cfg := *tx.Config
	cfg.Plugins = make(map[string]gorm.Plugin, len(tx.Config.Plugins)+1)
	maps.Copy(cfg.Plugins, tx.Config.Plugins)
	cfg.Plugins[withoutEventsName] = withoutEventsMark{}
	tx.Config = &cfg
	return tx
}

// withoutEventsName keys, in a gorm.Config's Plugins, the mark of a
// configuration that WithoutEvents made. The mark is never registered
// with db.Use, so GORM never initializes it.
const withoutEventsName = "outbox:without_events"

type withoutEventsMark struct{}

func (withoutEventsMark) Name() string              { return withoutEventsName }
func (withoutEventsMark) Initialize(*gorm.DB) error { return nil }

func eventsSkipped(db *gorm.DB) bool {
	_, ok := db.Config.Plugins[withoutEventsName]
	return ok
}

// pluginOf returns the outbox plugin registered on db.
func pluginOf(db *gorm.DB) (*OutboxPlugin, error) {
	if pl, ok := db.Config.Plugins[pluginName]; ok {
		if p, ok := pl.(*OutboxPlugin); ok {
			return p, nil
		}
	}
	return nil, ErrPluginNotRegistered
}

// The write path and the delivery path share two things besides the
// table: its name, and the in-process wake-up that the plugin gives after
// a write. The plugin registered on a *gorm.DB offers both through these
// interfaces, so that a dispatcher needs nothing else of it.
type (
	tableNamer interface{ Table() string }
	waker      interface {
		addWaker(wake func()) (remove func())
	}
)

// tableNameOf returns the table name of the outbox plugin registered on
// db, or DefaultTable when there is none.
func tableNameOf(db *gorm.DB) string {
	if p, ok := db.Config.Plugins[pluginName].(tableNamer); ok {
		return p.Table()
	}
	return DefaultTable
}

// wakerOf returns the in-process wake-up of the plugin registered on db.
func wakerOf(db *gorm.DB) (waker, bool) {
	w, ok := db.Config.Plugins[pluginName].(waker)
	return w, ok
}

package outbox

import (
	"context"
	"fmt"
	"reflect"
	"strconv"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/schema"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// registerCallbacks adds these callbacks to each of GORM's write chains:
//
//   - outbox:before_* runs just before GORM's before-hooks, after
//     gorm:begin_transaction. When the statement has no transaction
//     (SkipDefaultTransaction), it opens one; in the caller's transaction,
//     on an engine where a failed statement does not abort the
//     transaction, it sets a savepoint, so that a write that fails leaves
//     nothing behind even if the caller commits.
//   - outbox:returning_* and outbox:returned_* run around GORM's own
//     gorm:create, gorm:update and gorm:delete: GORM builds the statement,
//     the plugin runs it and learns the rows it wrote (returning.go).
//   - outbox:after_* runs after GORM's after-hooks and just before
//     gorm:commit_or_rollback_transaction, so that its rows go through the
//     statement's own transaction. (A callback registered only After the
//     write would be appended after the commit and write outside it.) It
//     asks the models for their events and writes them; it ends what
//     outbox:before_* opened.
//   - outbox:committed_* runs after gorm:commit_or_rollback_transaction and
//     wakes the dispatchers (see wake.go).
//
// Under a SkipDefaultTransaction configuration GORM registers neither of
// its transaction callbacks; outbox:after_* and outbox:committed_* then run
// last, in that order.
//
// What they learn about a statement travels in a writeState, which
// outbox:before_* replaces for every statement: GORM reuses a Statement,
// and its instance settings, when one *gorm.DB runs several.
func (p *OutboxPlugin) registerCallbacks(db *gorm.DB) error {
	type registerer interface {
		Register(name string, fn func(*gorm.DB)) error
	}
	cb := db.Callback()
	for _, c := range []struct {
		name string
		at   registerer
		fn   func(*gorm.DB)
	}{
		{"outbox:before_create", cb.Create().Before("gorm:before_create"), p.before},
		{"outbox:returning_create", cb.Create().Before("gorm:create").After("gorm:save_before_associations"), p.returning},
		{"outbox:returned_create", cb.Create().After("gorm:create").Before("gorm:save_after_associations"), p.returned(OpCreate)},
		{"outbox:after_create", cb.Create().Before("gorm:commit_or_rollback_transaction"), p.after},
		{"outbox:before_update", cb.Update().Before("gorm:before_update"), p.before},
		{"outbox:returning_update", cb.Update().Before("gorm:update").After("gorm:save_before_associations"), p.returning},
		{"outbox:returned_update", cb.Update().After("gorm:update").Before("gorm:save_after_associations"), p.returned(OpUpdate)},
		{"outbox:after_update", cb.Update().Before("gorm:commit_or_rollback_transaction"), p.after},
		{"outbox:before_delete", cb.Delete().Before("gorm:before_delete"), p.before},
		{"outbox:returning_delete", cb.Delete().Before("gorm:delete").After("gorm:delete_before_associations"), p.returning},
		{"outbox:returned_delete", cb.Delete().After("gorm:delete").Before("gorm:after_delete"), p.returned(OpDelete)},
		{"outbox:after_delete", cb.Delete().Before("gorm:commit_or_rollback_transaction"), p.after},
		{"outbox:committed_create", cb.Create().After("gorm:commit_or_rollback_transaction"), p.committedCallback},
		{"outbox:committed_update", cb.Update().After("gorm:commit_or_rollback_transaction"), p.committedCallback},
		{"outbox:committed_delete", cb.Delete().After("gorm:commit_or_rollback_transaction"), p.committedCallback},
	} {
		if err := c.at.Register(c.name, c.fn); err != nil {
			return fmt.Errorf("outbox: register callback %s: %w", c.name, err)
		}
	}
	return nil
}

// writeState is what the callbacks know of one statement on an emitting
// model.
type writeState struct {
	own       bool      // the statement's own transaction: GORM's default one, or opened
	opened    bool      // outbox:before_* opened it (SkipDefaultTransaction)
	savepoint savepoint // the one outbox:before_* set in the caller's transaction, if any
	tx        *txWrites // the transaction whose commit wakes the dispatchers; nil in the caller's

	replaced gorm.ConnPool // the statement's connection before outbox:before_* opened one
	config   *gorm.Config  // the statement's configuration while GORM's write is a dry run
	returned *returned     // the rows the write changed, once it has run
	// model is the emitting model of a statement GORM runs without one
	// (association.go), which the plugin's callbacks give the statement
	// while they run; nil for a statement with its own.
	model *schema.Schema
}

// withModel runs fn with st's model, if it has one, as stmt's schema.
func (st *writeState) withModel(stmt *gorm.Statement, fn func()) {
	if st.model != nil {
		stmt.Schema = st.model
		defer func() { stmt.Schema = nil }()
	}
	fn()
}

// gormStartedTxKey is the instance setting by which GORM's
// gorm:begin_transaction marks a statement whose transaction it opened
// (and gorm:commit_or_rollback_transaction will end).
const gormStartedTxKey = "gorm:started_transaction"

// stateKey keys a statement's writeState in its Settings. Like the keys of
// GORM's InstanceSet, it names the statement, so that a clone, which
// copies Settings, does not inherit the state; unlike them, it is built
// without formatting a string, which was a measurable part of the plugin's
// cost per write.
type stateKey struct{ stmt *gorm.Statement }

func stateOf(db *gorm.DB) *writeState {
	v, _ := db.Statement.Settings.Load(stateKey{db.Statement})
	st, _ := v.(*writeState)
	return st
}

// setState makes st the state of db's statement; nil clears it.
func setState(db *gorm.DB, st *writeState) {
	key := stateKey{db.Statement}
	if st == nil {
		db.Statement.Settings.Delete(key)
		return
	}
	db.Statement.Settings.Store(key, st)
}

// committedCallback wakes the dispatchers once a statement whose own
// transaction wrote events has committed. (In the caller's transaction
// the write itself arranged the wake-up; in a Transaction, the
// Transaction does after its commit.)
func (p *OutboxPlugin) committedCallback(db *gorm.DB) {
	st := stateOf(db)
	if st == nil {
		return
	}
	setState(db, nil)
	if st.own && st.tx != nil {
		// An error here may be a failed commit or one that a callback
		// after the commit added: a rolled-back write then costs a
		// wake-up that finds nothing, but a committed one is never left
		// without.
		st.tx.committed()
		st.tx.end()
	}
}

// savepoint names a savepoint that the plugin set in the caller's
// transaction ("" for none). Each has a name of its own (outbox_write_1,
// outbox_write_2, ...): MySQL and MariaDB replace an earlier savepoint of
// the same name where SQLite stacks them, so with one name a write inside
// another (an association, a hook's write or Publish) would take the
// outer write's savepoint with it, and the outer one could neither roll
// back nor release.
type savepoint string

// setSavepoint sets a savepoint of a new name through conn.
func (p *OutboxPlugin) setSavepoint(ctx context.Context, conn gorm.ConnPool) (savepoint, error) {
	sp := savepoint("outbox_write_" + strconv.FormatUint(p.savepoints.Add(1), 10))
	if _, err := conn.ExecContext(ctx, "SAVEPOINT "+string(sp)); err != nil {
		return "", fmt.Errorf("outbox: savepoint: %w", err)
	}
	return sp, nil
}

// rollback undoes everything since the savepoint was set, and keeps it.
func (sp savepoint) rollback(ctx context.Context, conn gorm.ConnPool) error {
	_, err := conn.ExecContext(ctx, "ROLLBACK TO SAVEPOINT "+string(sp))
	return err
}

// release forgets the savepoint, keeping what was written since.
func (sp savepoint) release(ctx context.Context, conn gorm.ConnPool) error {
	if _, err := conn.ExecContext(ctx, "RELEASE SAVEPOINT "+string(sp)); err != nil {
		return fmt.Errorf("outbox: release savepoint: %w", err)
	}
	return nil
}

func (p *OutboxPlugin) before(db *gorm.DB) {
	setState(db, nil)
	if db.Error != nil || eventsSkipped(db) {
		return
	}
	stmt := db.Statement
	st := &writeState{}
	if stmt.Schema == nil {
		model, err := p.associationModel(stmt)
		if err != nil {
			_ = db.AddError(err)
			return
		}
		if model == nil {
			return
		}
		st.model = model
	} else if p.emitterFor(stmt.Schema.ModelType) == nil {
		return
	}
	setState(db, st)
	if _, inTx := stmt.ConnPool.(gorm.TxCommitter); inTx {
		_, started := db.InstanceGet(gormStartedTxKey)
		st.own = started && !db.Config.SkipDefaultTransaction
		if st.own {
			st.tx = &txWrites{p: p}
			return
		}
		st.tx = txWritesOf(db, p)
		if d, err := dialect.For(db); err == nil && !d.ErrorAbortsTx() && !db.DryRun {
			sp, err := p.setSavepoint(stmt.Context, plainConn(stmt.ConnPool))
			if err != nil {
				_ = db.AddError(err)
				return
			}
			st.savepoint = sp
		}
		return
	}
	tx := db.Begin()
	if tx.Error != nil {
		_ = db.AddError(fmt.Errorf("outbox: begin transaction: %w", tx.Error))
		return
	}
	st.replaced = stmt.ConnPool
	stmt.ConnPool = tx.Statement.ConnPool
	st.own, st.opened = true, true
	st.tx = &txWrites{p: p}
}

func (p *OutboxPlugin) after(db *gorm.DB) {
	st := stateOf(db)
	if st == nil {
		return
	}
	completed := false
	defer func() { p.finishTransaction(db, st, completed) }()
	st.withModel(db.Statement, func() { p.writeEvents(db, st) })
	completed = true
}

// writeEvents asks the models the statement wrote for their events and
// records them through its connection.
func (p *OutboxPlugin) writeEvents(db *gorm.DB, st *writeState) {
	stmt := db.Statement
	if db.Error != nil || st.returned == nil || len(st.returned.rows) == 0 {
		return
	}
	emit := p.emitterFor(stmt.Schema.ModelType)
	if emit == nil {
		return
	}
	var events []Event
	for _, w := range st.returned.rowsWritten(stmt) {
		evs, err := emit(w.model.Addr().Interface(), w.op)
		if err != nil {
			_ = db.AddError(fmt.Errorf("outbox: %s.OutboxEvents(%s): %w", stmt.Schema.Name, w.op, err))
			return
		}
		events = append(events, evs...)
	}
	if err := p.record(db, events, st.tx, false); err != nil {
		_ = db.AddError(err)
	}
}

// finishTransaction ends what outbox:before_* left open. If writeEvents
// did not complete (an emitter panicked, or called runtime.Goexit), it
// rolls back the statement's own transaction, GORM's too (GORM would leave
// it open), or to the savepoint, and lets the panic go on. Otherwise it
// commits or rolls back the transaction that outbox:before_* opened, or
// releases its savepoint (rolling back to it first if the statement
// failed), and hands the statement back the connection it had. (A panic
// between outbox:before_* and outbox:after_*, in a hook or another
// plugin's callback, leaves that transaction open, as GORM leaves its
// own.)
func (p *OutboxPlugin) finishTransaction(db *gorm.DB, st *writeState, completed bool) {
	stmt := db.Statement
	if st.config != nil { // GORM's write never reached outbox:returned_*
		db.Config, st.config = st.config, nil
	}
	if sp := st.savepoint; sp != "" {
		st.savepoint = ""
		conn := plainConn(stmt.ConnPool)
		if !completed || db.Error != nil {
			// The statement's error is the one to report; one of the
			// rollback is added to it, not in its place.
			if err := sp.rollback(stmt.Context, conn); err != nil && db.Error != nil {
				db.Error = fmt.Errorf("%w (and the rollback to savepoint %s failed: %v)", db.Error, sp, err)
			}
		}
		if err := sp.release(stmt.Context, conn); err != nil && completed {
			_ = db.AddError(err)
		}
		return
	}
	if !st.own && db.Error != nil && st.returned != nil && (len(st.returned.rows) > 0 || st.returned.unread) {
		// The caller's transaction holds rows whose events failed, or
		// rows the plugin could not read.
		if d, err := dialect.For(db); err == nil {
			if a, ok := d.(dialect.Aborter); ok {
				_ = a.AbortTx(stmt.Context, plainConn(stmt.ConnPool)) // it fails by design
			}
		}
	}
	if !completed {
		if st.own {
			db.Rollback()
			stmt.ConnPool = st.restore(db)
			st.tx.end()
		}
		return
	}
	if !st.opened {
		return
	}
	if db.Error != nil {
		db.Rollback()
	} else {
		db.Commit()
	}
	stmt.ConnPool = st.restore(db)
}

// plainConn returns conn without GORM's prepared-statement wrapper
// (PrepareStmt), so that the plugin's own statements (event inserts,
// savepoints) do not fill the caller's statement cache: the driver
// prepares them as it does any statement.
func plainConn(conn gorm.ConnPool) gorm.ConnPool {
	switch c := conn.(type) {
	case *gorm.PreparedStmtTX:
		return c.Tx
	case *gorm.PreparedStmtDB:
		return c.ConnPool
	}
	return conn
}

// restore returns the connection to put back on db's statement when its
// own transaction ends: the one outbox:before_* replaced, or the pool,
// as GORM does after its own transaction.
func (st *writeState) restore(db *gorm.DB) gorm.ConnPool {
	if st.replaced != nil {
		return st.replaced
	}
	return db.ConnPool
}

// eachModel calls fn with every model struct held by rv (a struct, or a
// slice or array of structs or pointers to structs), always addressable.
func eachModel(rv reflect.Value, fn func(reflect.Value)) {
	switch rv.Kind() {
	case reflect.Slice, reflect.Array:
		for i := 0; i < rv.Len(); i++ {
			eachModel(reflect.Indirect(rv.Index(i)), fn)
		}
	case reflect.Struct:
		if !rv.CanAddr() {
			cp := reflect.New(rv.Type()).Elem()
			cp.Set(rv)
			rv = cp
		}
		fn(rv)
	}
}

// record writes events through db's connection and arranges the
// wake-up of the dispatchers: the one write path of the hooks, Publish and
// Transaction. In a transaction whose commit the plugin sees (w, not
// ended), w decides whether the engine notifies at the commit or w's
// notifier after it (see wake.go); in the caller's transaction (w nil or
// ended), the engine notifies at its commit and the dispatchers of this
// process are nudged at once. With guard, on an engine where a failed
// statement does not abort the transaction, the events are written inside
// a savepoint, so that a failure leaves none of them behind.
func (p *OutboxPlugin) record(db *gorm.DB, events []Event, w *txWrites, guard bool) error {
	if len(events) == 0 {
		return nil
	}
	d, err := dialect.For(db)
	if err != nil {
		return err
	}
	encoded, err := encodeAll(p.withContextHeaders(db.Statement.Context, events), p.payloadLimit())
	if err != nil {
		return err
	}
	if w == nil || w.ended.Load() {
		_, err = p.store(db, d, encoded, p.notify, guard)
		p.wake()
		return err
	}
	return w.write(db, func(notify bool) (bool, error) { return p.store(db, d, encoded, notify, guard) })
}

// encodeAll validates and encodes every event, and refuses one whose
// encoded payload is longer than maxPayload bytes, so that a bad one
// writes nothing.
func encodeAll(events []Event, maxPayload int) ([]dialect.Record, error) {
	now := time.Now()
	encoded := make([]dialect.Record, len(events))
	for i, ev := range events {
		var err error
		if encoded[i], err = ev.encode(now); err != nil {
			return nil, err
		}
		if n := len(encoded[i].Payload); n > maxPayload {
			return nil, fmt.Errorf("%w %q: payload is %d bytes encoded, more than the %d allowed (WithMaxPayloadBytes)",
				ErrInvalidEvent, short(ev.Type), n, maxPayload)
		}
	}
	return encoded, nil
}

// store writes encoded events through db's connection in order. With
// notify, it also asks the engine to notify listeners when the
// transaction commits, and reports whether it did (not when every event
// was stored already). With guard (see record), a savepoint surrounds the
// writes.
func (p *OutboxPlugin) store(db *gorm.DB, d dialect.Dialect, encoded []dialect.Record, notify, guard bool) (notified bool, err error) {
	ctx, conn := db.Statement.Context, plainConn(db.Statement.ConnPool)
	if guard && !d.ErrorAbortsTx() {
		sp, serr := p.setSavepoint(ctx, conn)
		if serr != nil {
			return false, serr
		}
		defer func() { // on the named results
			if err != nil {
				notified = false
				if rerr := sp.rollback(ctx, conn); rerr != nil {
					err = fmt.Errorf("%w (and the rollback to savepoint %s failed: %v)", err, sp, rerr)
				}
			}
			if rerr := sp.release(ctx, conn); rerr != nil && err == nil {
				err = rerr
			}
		}()
	}
	now := time.Now()
	for i := range encoded {
		// One notification per transaction is enough: PostgreSQL folds
		// identical ones, but sending it once saves the work. It rides on
		// the first event actually inserted: one whose idempotency key is
		// stored already is skipped, and its notification with it.
		inserted, err := d.InsertEvent(ctx, conn, p.tables, &encoded[i], now, notify && !notified)
		if inserted && notify {
			notified = true
		}
		if err != nil {
			e := &encoded[i]
			if d.RejectsData(err) {
				return notified, fmt.Errorf("%w %q: the database refused a value: %w", ErrInvalidEvent, short(e.Type), err)
			}
			return notified, fmt.Errorf("outbox: write event %q (%s %s/%s): %w", short(e.ID), short(e.Type), short(e.AggregateType), short(e.AggregateID), err)
		}
	}
	return notified, nil
}

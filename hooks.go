package outbox

import (
	"context"
	"fmt"
	"reflect"
	"time"

	"gorm.io/gorm"
)

// registerCallbacks adds three callbacks to each of GORM's write chains:
//
//   - outbox:before_* runs just before GORM's before-hooks, after
//     gorm:begin_transaction. It refuses writes on emitting models that it
//     could not describe (bulk writes by condition, creates from maps)
//     before anything is written, and, when the statement has no
//     transaction (SkipDefaultTransaction), opens one.
//   - outbox:after_* runs after GORM's after-hooks and just before
//     gorm:commit_or_rollback_transaction, so that its rows go through the
//     statement's own transaction. (A callback registered only After the
//     write would be appended after the commit and write outside it.) It
//     asks the models for their events and writes them; if outbox:before_*
//     opened the transaction, it commits or rolls it back.
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
		{"outbox:before_create", cb.Create().Before("gorm:before_create"), p.before(OpCreate)},
		{"outbox:after_create", cb.Create().Before("gorm:commit_or_rollback_transaction"), p.after(OpCreate)},
		{"outbox:before_update", cb.Update().Before("gorm:before_update"), p.before(OpUpdate)},
		{"outbox:after_update", cb.Update().Before("gorm:commit_or_rollback_transaction"), p.after(OpUpdate)},
		{"outbox:before_delete", cb.Delete().Before("gorm:before_delete"), p.before(OpDelete)},
		{"outbox:after_delete", cb.Delete().Before("gorm:commit_or_rollback_transaction"), p.after(OpDelete)},
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
	own      bool      // the statement's own transaction: GORM's default one, or opened
	opened   bool      // outbox:before_* opened it (SkipDefaultTransaction)
	counted  bool      // counted in OutboxPlugin.ownInFlight
	wrote    bool      // events were written
	inside   bool      // the transaction was asked to notify at its commit
	notifier *notifier // sends the notification after the commit, if any
	tx       *txWrites // the Transaction the statement runs in, which wakes the dispatchers

	replaced gorm.ConnPool // the statement's connection before outbox:before_* opened one
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

// committedCallback wakes the dispatchers once a statement that wrote
// events has committed. Inside the caller's transaction, whose commit no
// callback sees, it can only nudge this process's dispatchers, before the
// commit (Dispatcher.Run then looks again shortly); the write itself asked
// PostgreSQL to notify the others at commit. Inside a Transaction it does
// nothing: the Transaction wakes them after its commit.
func (p *OutboxPlugin) committedCallback(db *gorm.DB) {
	st := stateOf(db)
	if st == nil {
		return
	}
	setState(db, nil)
	p.uncount(st)
	if !st.wrote || st.tx != nil {
		return // a Transaction wakes the dispatchers after its commit
	}
	// An error here may be a failed commit or one that a callback after
	// the commit added: a rolled-back write then costs a wake-up that
	// finds nothing, but a committed one is never left without.
	if st.own {
		p.committed(st.notifier, st.inside)
	} else {
		p.wake()
	}
}

func (p *OutboxPlugin) before(op Op) func(*gorm.DB) {
	return func(db *gorm.DB) {
		setState(db, nil)
		if db.Error != nil || eventsSkipped(db) {
			return
		}
		stmt := db.Statement
		if stmt.Schema == nil || p.emitterFor(stmt.Schema.ModelType) == nil {
			return
		}
		if err := describable(stmt, op); err != nil {
			_ = db.AddError(err)
			return
		}
		st := &writeState{}
		setState(db, st)
		_, inTx := stmt.ConnPool.(gorm.TxCommitter)
		if inTx {
			_, started := db.InstanceGet(gormStartedTxKey)
			st.own = started && !db.Config.SkipDefaultTransaction
			if !st.own {
				st.tx = txWritesOf(db, p)
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
	}
}

func (p *OutboxPlugin) after(op Op) func(*gorm.DB) {
	return func(db *gorm.DB) {
		st := stateOf(db)
		if st == nil {
			return
		}
		completed := false
		defer func() { p.finishTransaction(db, st, completed) }()
		p.writeEvents(db, st, op)
		completed = true
	}
}

// writeEvents asks the statement's models for their events and writes
// them through its connection.
func (p *OutboxPlugin) writeEvents(db *gorm.DB, st *writeState, op Op) {
	stmt := db.Statement
	if db.Error != nil || stmt.Schema == nil {
		return
	}
	emit := p.emitterFor(stmt.Schema.ModelType)
	if emit == nil {
		return
	}
	// An update or delete of one identified row that matched nothing
	// changed nothing, so there is no fact to report.
	if op != OpCreate && stmt.ReflectValue.Kind() == reflect.Struct && db.RowsAffected == 0 {
		return
	}
	var events []Event
	err := eachModel(stmt.ReflectValue, func(model reflect.Value) error {
		evs, err := emit(model.Addr().Interface(), op)
		if err != nil {
			return fmt.Errorf("outbox: %s.OutboxEvents(%s): %w", stmt.Schema.Name, op, err)
		}
		events = append(events, evs...)
		return nil
	})
	switch {
	case err != nil || len(events) == 0:
	case st.tx != nil:
		err = st.tx.write(db, events)
	default:
		if st.own {
			p.ownInFlight.Add(1)
			st.counted = true
			st.notifier = p.notifierFor(db)
		}
		st.inside = p.notifyInside(st.notifier, st.own)
		_, err = p.write(stmt.Context, db, stmt.ConnPool, events, st.inside)
	}
	if err != nil {
		_ = db.AddError(err)
	} else if len(events) > 0 {
		st.wrote = true
	}
}

// finishTransaction ends what outbox:after_* leaves open. If writeEvents
// did not complete (an emitter panicked, or called runtime.Goexit), it
// rolls back the statement's own transaction, GORM's too (GORM would leave
// it open), and lets the panic go on. Otherwise it commits or rolls back
// the transaction that outbox:before_* opened, if it did, and hands the
// statement back the connection it had. (A panic between outbox:before_*
// and outbox:after_*, in a hook or another plugin's callback, leaves that
// transaction open, as GORM leaves its own.)
func (p *OutboxPlugin) finishTransaction(db *gorm.DB, st *writeState, completed bool) {
	if !completed {
		if st.own {
			db.Rollback()
			db.Statement.ConnPool = st.restore(db)
		}
		p.uncount(st)
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
	db.Statement.ConnPool = st.restore(db)
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

// uncount takes st's transaction out of ownInFlight once it has ended.
func (p *OutboxPlugin) uncount(st *writeState) {
	if st.counted {
		st.counted = false
		p.ownInFlight.Add(-1)
	}
}

// describable reports why the plugin cannot build the events of stmt, if it
// cannot: events are built from model values, so the statement must carry
// them, and an update or delete must name its rows by primary key.
func describable(stmt *gorm.Statement, op Op) error {
	rv := stmt.ReflectValue
	switch rv.Kind() {
	case reflect.Struct, reflect.Slice, reflect.Array:
	default:
		return fmt.Errorf("%w: %s of %s from a %s: events are built from model values; write a %s value, or run the statement through outbox.WithoutEvents and record events with outbox.Publish",
			ErrUnidentifiedRows, op, stmt.Schema.Name, rv.Kind(), stmt.Schema.Name)
	}
	if op == OpCreate {
		return nil
	}
	if len(stmt.Schema.PrimaryFields) == 0 {
		return fmt.Errorf("%w: %s of %s: the model has no primary key", ErrUnidentifiedRows, op, stmt.Schema.Name)
	}
	anonymous := rv.Kind() != reflect.Struct && rv.Len() == 0
	_ = eachModel(rv, func(model reflect.Value) error {
		for _, pk := range stmt.Schema.PrimaryFields {
			if _, zero := pk.ValueOf(stmt.Context, model); zero {
				anonymous = true
			}
		}
		return nil
	})
	if anonymous {
		return fmt.Errorf("%w: %s of %s by condition: the plugin cannot tell which rows change; load the rows and write each one (db.Model(&row).Updates(...), db.Delete(&row)), or run the statement through outbox.WithoutEvents and record events with outbox.Publish",
			ErrUnidentifiedRows, op, stmt.Schema.Name)
	}
	return nil
}

// eachModel calls fn with every model struct held by rv (a struct, or a
// slice or array of structs or pointers to structs), always addressable.
func eachModel(rv reflect.Value, fn func(reflect.Value) error) error {
	switch rv.Kind() {
	case reflect.Slice, reflect.Array:
		for i := 0; i < rv.Len(); i++ {
			if err := eachModel(reflect.Indirect(rv.Index(i)), fn); err != nil {
				return err
			}
		}
		return nil
	case reflect.Struct:
		if !rv.CanAddr() {
			cp := reflect.New(rv.Type()).Elem()
			cp.Set(rv)
			rv = cp
		}
		return fn(rv)
	default:
		return nil
	}
}

// write validates and encodes every event first, so that a bad one writes
// nothing, then stores them through conn in order. With notify, it also
// asks the engine to notify listeners when the transaction commits, and
// reports whether it did (not when every event was stored already).
func (p *OutboxPlugin) write(ctx context.Context, db *gorm.DB, conn gorm.ConnPool, events []Event, notify bool) (notified bool, err error) {
	if len(events) == 0 {
		return false, nil
	}
	d, err := dialectOf(db)
	if err != nil {
		return false, err
	}
	now := time.Now()
	encoded := make([]encodedEvent, len(events))
	for i, ev := range p.withContextHeaders(ctx, events) {
		if encoded[i], err = ev.encode(now); err != nil {
			return false, err
		}
	}
	for i := range encoded {
		// One notification per transaction is enough: PostgreSQL folds
		// identical ones, but sending it once saves the work. It rides on
		// the first event actually inserted: one whose idempotency key is
		// stored already is skipped, and its notification with it.
		inserted, err := d.insertEvent(ctx, conn, p.tables, &encoded[i], now, notify && !notified)
		if inserted && notify {
			notified = true
		}
		if err != nil {
			e := &encoded[i]
			if d.rejectsData(err) {
				return notified, fmt.Errorf("%w %q: the database refused a value: %w", ErrInvalidEvent, e.typ, err)
			}
			return notified, fmt.Errorf("outbox: write event %q (%s %s/%s): %w", e.id, e.typ, e.aggregateType, e.aggregateID, err)
		}
	}
	return notified, nil
}

package outbox

import (
	"gorm.io/gorm"
)

// Publish records events that are not tied to a model write, through tx's
// connection: inside the caller's transaction when tx is one (typically the
// tx of db.Transaction or of [Transaction]), so that the events commit if
// and only if it does. Called outside a transaction, Publish opens one for
// the events alone, so that they are written all or none.
//
// Every event is validated and encoded before anything is written; an
// invalid one fails the whole call with an error wrapping
// [ErrInvalidEvent]. An event whose IdempotencyKey is already stored is
// skipped without error. Publish fails with [ErrPluginNotRegistered] when
// the outbox plugin was not registered on tx.
func Publish(tx *gorm.DB, events ...Event) error {
	if tx.Error != nil {
		return tx.Error
	}
	p, err := pluginOf(tx)
	if err != nil {
		return err
	}
	if len(events) == 0 {
		return nil
	}
	if _, inTx := tx.Statement.ConnPool.(gorm.TxCommitter); inTx {
		if w := txWritesOf(tx, p); w != nil {
			return w.write(tx, events) // Transaction wakes the dispatchers after its commit
		}
		_, err = p.write(tx.Statement.Context, tx, tx.Statement.ConnPool, events, p.notifyInside(nil, false))
		if err == nil {
			p.wake()
		}
		return err
	}
	p.ownInFlight.Add(1)
	defer p.ownInFlight.Add(-1)
	var (
		n      *notifier
		inside bool
	)
	err = tx.Transaction(func(tx *gorm.DB) error {
		n = p.notifierFor(tx)
		inside = p.notifyInside(n, true)
		_, err := p.write(tx.Statement.Context, tx, tx.Statement.ConnPool, events, inside)
		return err
	})
	if err == nil {
		p.committed(n, inside)
	}
	return err
}

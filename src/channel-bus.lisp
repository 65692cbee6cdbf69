;;;; The protocol of a channel bus: what carries a PUBLISH (channels.lisp)
;;;; to the subscribers of other processes.  The one there is keeps them in
;;;; PostgreSQL (the /postgresql system's event-bus.lisp).

(in-package #:hunchentoot-recycling-taskmaster)

(defvar *channel-bus* nil
  "NIL, or the bus a publish also goes to, for the subscribers of other
processes (BUS-PUBLISH); a message from it is delivered here by
DELIVER-PUBLISHED.")

(defgeneric bus-publish (bus channel message event id)
  (:documentation "Send MESSAGE, published to CHANNEL here with EVENT and ID,
to the other processes on BUS, without waiting on them.  True when it was
taken; NIL when the bus has too many waiting already."))

(defgeneric bus-statistics (bus)
  (:documentation "What BUS has counted, as a plist under the :BUS- keys of
*STATISTICS-KEYS*.")
  (:method ((bus null))
    (list :bus-messages-out 0 :bus-messages-in 0 :bus-messages-dropped 0
          :bus-messages-missed 0 :bus-reconnects 0)))

;;;; Channels: named sets of subscribers -- event streams and websocket
;;;; clients -- that a message published to the channel reaches, from any
;;;; thread, without waiting on any of them.  A subscriber leaves its
;;;; channels when it ends.  With a bus (*CHANNEL-BUS*, channel-bus.lisp), a
;;;; publish also reaches the subscribers of every other process sharing it.
;;;;
;;;; *CHANNELS-LOCK* guards the table; each channel's LOCK its list of
;;;; subscribers, which a publish copies out before it sends.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +max-published-octets+ (* 1024 1024)
  "The longest message PUBLISH takes, in octets of UTF-8: one that would
fill the default queue of every subscriber at once is a mistake.")

(defstruct (channel (:constructor make-channel (name)))
  (name "" :type string :read-only t)
  (lock (bt:make-lock "channel") :read-only t)
  ;; EVENT-STREAMs and WS:WEBSOCKET-CLIENTs.
  (subscribers '()))

(defvar *channels* (make-hash-table :test 'equal)
  "Channel name -> CHANNEL, for every channel with a subscriber.")

(defvar *channels-lock* (bt:make-lock "channels"))

(defun find-channel (name create-p)
  (bt:with-lock-held (*channels-lock*)
    (or (gethash name *channels*)
        (and create-p (setf (gethash name *channels*) (make-channel name))))))

(defun subscriber-open-p (subscriber)
  (if (event-stream-p subscriber)
      (event-stream-open-p subscriber)
      (ws:client-open-p subscriber)))

(defun unsubscribe (channel-name subscriber)
  "Take SUBSCRIBER out of the channel CHANNEL-NAME."
  (let ((channel (find-channel channel-name nil)))
    (when channel
      (bt:with-lock-held ((channel-lock channel))
        (setf (channel-subscribers channel) (remove subscriber (channel-subscribers channel))))
      (bt:with-lock-held (*channels-lock*)
        (when (and (null (channel-subscribers channel)) (eq channel (gethash channel-name *channels*)))
          (remhash channel-name *channels*))))))

(defun subscribe (channel-name subscriber)
  "Make SUBSCRIBER, an EVENT-STREAM or a WS:WEBSOCKET-CLIENT, receive what
is published to the channel named CHANNEL-NAME (a string), until it ends
or UNSUBSCRIBE.  Returns SUBSCRIBER."
  (check-type channel-name string)
  (check-type subscriber (or event-stream ws:websocket-client))
  (let ((channel (find-channel channel-name t)))
    (bt:with-lock-held ((channel-lock channel))
      (pushnew subscriber (channel-subscribers channel)))
    (when (event-stream-p subscriber)
      (add-event-stream-end-hook subscriber (lambda (stream) (unsubscribe channel-name stream))))
    subscriber))

(defun deliver-published (channel-name message event id)
  "Send MESSAGE to the subscribers of CHANNEL-NAME in this process: an event
to event streams (with EVENT and ID), a text message to websocket clients.
The number of subscribers it was sent to; those that have ended are
dropped."
  (let* ((channel (find-channel channel-name nil))
         (subscribers (and channel (bt:with-lock-held ((channel-lock channel))
                                     (copy-list (channel-subscribers channel)))))
         (counted nil)
         (count 0))
    (unwind-protect
         (dolist (subscriber subscribers)
           (cond ((not (subscriber-open-p subscriber))
                  (unsubscribe channel-name subscriber))
                 ((event-stream-p subscriber)
                  (unless counted
                    ;; Made once, held by every stream it goes to.
                    (setf counted (or (event-octets (readiness-set-memory-budget (event-stream-set subscriber))
                                                    message :event event :id id)
                                      (return))))
                  (when (offer-event subscriber counted)
                    (incf count)))
                 ((ws:send-text-message subscriber message)
                  (incf count))))
      (when counted
        (let-go-of-counted-octets counted)))
    count))

(defun publish (channel-name message &key event id)
  "Send MESSAGE, a string, to every subscriber of the channel named
CHANNEL-NAME, from any thread, without waiting on any: an event (named
EVENT, with ID) to event streams, a text message to websocket clients;
with a *CHANNEL-BUS*, to the subscribers of other processes too, in the
order published from this process.  The number of this process's
subscribers it was sent to.  Signals EVENT-FIELD-REFUSED for an EVENT or
ID with a line break, MESSAGE-TOO-LONG for a MESSAGE over
+MAX-PUBLISHED-OCTETS+."
  (check-type channel-name string)
  (check-type message string)
  (let ((octets (utf-8-length (coerce message 'simple-string))))
    (when (> octets +max-published-octets+)
      (error 'message-too-long :octets octets :limit +max-published-octets+)))
  (when event (check-event-field :event (string event)))
  (when id (check-event-field :id (princ-to-string id)))
  (let ((bus *channel-bus*))
    (when bus
      (bus-publish bus channel-name message event id)))
  (deliver-published channel-name message event id))

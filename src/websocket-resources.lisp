;;;; Websockets in hunchensocket's shape: the resources a request may open a
;;;; websocket on, found through *WEBSOCKET-DISPATCH-TABLE*; their clients;
;;;; and the generic functions through which a resource hears from its
;;;; clients.  The symbols are the package HUNCHENTOOT-RECYCLING-WEBSOCKET's
;;;; (WS here).  The engine calls these functions
;;;; (engine/serving/websocket-turn.lisp); sending is websocket-sending.lisp.

(in-package #:hunchentoot-recycling-taskmaster)

(defvar ws:*websocket-dispatch-table* '()
  "Functions of a request, tried in order for each request that asks for a
websocket on a parallel acceptor: the first WEBSOCKET-RESOURCE one returns
serves the websocket.  A request none answers is dispatched as any other
request (a 404 from an easy acceptor).")

(defclass ws:websocket-resource ()
  ((client-numbers
    :initform (make-hash-table :test 'eq) :reader resource-client-numbers
    :documentation "Each client whose websocket is open on this resource,
to the number it was given when it came (later ones higher): a client
comes and goes in constant time, however many there are.")
   (next-client-number
    :initform 0
    :documentation "The number the next client comes with.")
   (clients-snapshot
    :initform '()
    :documentation "The list CLIENTS returns, made when it is first asked
for after a client came or went; :STALE until then.")
   (clients-lock
    :initform (bt:make-lock "websocket resource clients") :reader resource-clients-lock
    :documentation "Held while a client comes or goes and while the
snapshot is made; never around a call out.")
   (client-class
    :initarg :client-class :reader resource-client-class
    :documentation "The class of the WEBSOCKET-CLIENTs made for this
resource's websockets, a subclass of WEBSOCKET-CLIENT.")
   (subprotocols
    :initarg :subprotocols :reader resource-subprotocols
    :documentation "The subprotocols this resource speaks, in its order of
preference: the first one a client offers in Sec-WebSocket-Protocol is
chosen (CLIENT-SUBPROTOCOL).  NIL: none is chosen.")
   (origins
    :initarg :origins :reader resource-origins
    :documentation "T to take websockets from pages of any origin (as
hunchensocket does), or the list of Origin values taken, such as
(\"https://example.com\"); a request from another origin is answered
403.  Browsers send Origin; a request without it is taken."))
  (:default-initargs :client-class 'ws:websocket-client :subprotocols '() :origins t)
  (:documentation "Something a websocket may be opened on.  Subclass it and
specialize TEXT-MESSAGE-RECEIVED and the other generic functions of
HUNCHENTOOT-RECYCLING-WEBSOCKET on the subclass."))

(defclass ws:websocket-client ()
  ((request
    :initarg :request :reader ws:client-request
    :documentation "The HUNCHENTOOT:REQUEST that opened the websocket.")
   (subprotocol
    :initarg :subprotocol :reader ws:client-subprotocol
    :documentation "The subprotocol chosen for this websocket, or NIL.")
   (websocket
    :initform nil :accessor client-websocket
    :documentation "The engine's WEBSOCKET of the connection, set before
CLIENT-CONNECTED is called."))
  (:default-initargs :subprotocol nil)
  (:documentation "One open websocket of a resource.  It is made with
:REQUEST and, as hunchensocket makes its clients, each header of the
request as an initarg (:USER-AGENT ...), which a subclass may take."))

(defmethod initialize-instance :after ((client ws:websocket-client) &key &allow-other-keys)
  "Takes the request's headers as initargs, which a subclass may ignore.")

(defmethod print-object ((resource ws:websocket-resource) stream)
  (print-unreadable-object (resource stream :type t :identity t)
    (format stream "~D client~:P" (hash-table-count (resource-client-numbers resource)))))

(defgeneric ws:clients (resource)
  (:documentation "The clients whose websockets are open on RESOURCE,
newest first: a list never changed in place, so that a thread may loop
over it while clients come and go.")
  (:method ((resource ws:websocket-resource))
    (let ((snapshot (slot-value resource 'clients-snapshot)))
      (if (listp snapshot)
          snapshot
          (bt:with-lock-held ((resource-clients-lock resource))
            (let ((snapshot (slot-value resource 'clients-snapshot)))
              (if (listp snapshot)
                  snapshot
                  (setf (slot-value resource 'clients-snapshot)
                        (mapcar #'cdr (sort (loop for client being the hash-keys of (resource-client-numbers resource)
                                                    using (hash-value number)
                                                  collect (cons number client))
                                            #'> :key #'car))))))))))

(defun add-resource-client (resource client)
  "Make CLIENT one of RESOURCE's CLIENTS."
  (bt:with-lock-held ((resource-clients-lock resource))
    (setf (gethash client (resource-client-numbers resource)) (incf (slot-value resource 'next-client-number))
          (slot-value resource 'clients-snapshot) :stale)))

(defun remove-resource-client (resource client)
  "CLIENT is no longer one of RESOURCE's CLIENTS."
  (bt:with-lock-held ((resource-clients-lock resource))
    (remhash client (resource-client-numbers resource))
    (setf (slot-value resource 'clients-snapshot) :stale)))

(defun find-websocket-resource (request)
  "The resource the first function of *WEBSOCKET-DISPATCH-TABLE* returns for
REQUEST, or NIL."
  (some (lambda (dispatcher) (funcall dispatcher request)) ws:*websocket-dispatch-table*))

;;; What a resource hears.

(defgeneric ws:origin-allowed-p (resource origin)
  (:documentation "True when a page from ORIGIN (the Origin header, or NIL
when the request has none) may open a websocket on RESOURCE.  The method
for WEBSOCKET-RESOURCE follows its :ORIGINS.")
  (:method ((resource ws:websocket-resource) origin)
    (let ((origins (resource-origins resource)))
      (or (eq origins t) (null origin) (member origin origins :test #'string-equal)))))

(defgeneric ws:client-connected (resource client)
  (:documentation "CLIENT's websocket on RESOURCE has opened (the 101 is
sent).  Called on a worker, before any of CLIENT's messages.")
  (:method ((resource ws:websocket-resource) client)
    (declare (ignore client))))

(defgeneric ws:client-disconnected (resource client)
  (:documentation "CLIENT's websocket on RESOURCE has closed, and CLIENT is
no longer among (CLIENTS RESOURCE).  Called once, by whichever thread
closed it: a worker, the pool's maintenance thread at a timeout, or
HUNCHENTOOT:STOP.  Sends to CLIENT are dropped from now on.")
  (:method ((resource ws:websocket-resource) client)
    (declare (ignore client))))

(defgeneric ws:text-message-received (resource client message)
  (:documentation "CLIENT sent the text MESSAGE, a string.  Called on a
worker once the whole message has arrived; one client's messages are
handled one at a time, in order, different clients' in parallel.  The
request that opened the websocket is HUNCHENTOOT:*REQUEST* meanwhile.  An
error escaping it is logged and closes CLIENT with 1011.  The method for
WEBSOCKET-RESOURCE closes CLIENT with 1003: it takes no text."))

(defgeneric ws:binary-message-received (resource client octets)
  (:documentation "CLIENT sent the binary message OCTETS, a fresh vector of
(UNSIGNED-BYTE 8), as TEXT-MESSAGE-RECEIVED is called for text.  The method
for WEBSOCKET-RESOURCE closes CLIENT with 1003: it takes no binary."))

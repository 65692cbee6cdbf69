;;;; The acceptor's document root, served where Hunchentoot serves it.
;;;;
;;;; Hunchentoot serves the document root in its last ACCEPTOR-DISPATCH-REQUEST
;;;; method, the one on HUNCHENTOOT:ACCEPTOR, which every mixin's method
;;;; reaches by CALL-NEXT-METHOD when it does not answer.  Ours takes exactly
;;;; that place: the method on STATIC-DOCUMENT-ROOT runs the primary methods
;;;; that come after it in the chain, whatever mixins put there and in
;;;; whatever order, with Hunchentoot's last method replaced by
;;;; SERVE-DOCUMENT-ROOT.  Every method dispatches as it does on Hunchentoot's
;;;; own acceptor; only the file goes out by SERVE-STATIC-FILE.  The chain is
;;;; computed once and kept until a method of the generic function is added
;;;; or removed.

(in-package #:hunchentoot-recycling-taskmaster)

(defun serve-document-root (acceptor request)
  "Hunchentoot's last ACCEPTOR-DISPATCH-REQUEST method, the file sent by
SERVE-STATIC-FILE: the file under HUNCHENTOOT:ACCEPTOR-DOCUMENT-ROOT that
REQUEST's path names (index.html for /), or 404 when there is no document
root or the path is refused."
  (let ((root (hunchentoot:acceptor-document-root acceptor))
        (path (hunchentoot:request-pathname request)))
    (if (and root path)
        (serve-static-file (merge-pathnames (if (equal "/" (hunchentoot:script-name request)) #p"index.html" path)
                                            root))
        (end-request-with hunchentoot:+http-not-found+))))

(defun hunchentoot-last-dispatch-method ()
  "Hunchentoot's ACCEPTOR-DISPATCH-REQUEST method on HUNCHENTOOT:ACCEPTOR."
  (find-method #'hunchentoot:acceptor-dispatch-request '()
               (list (find-class 'hunchentoot:acceptor) (find-class t))))

(defun document-root-method ()
  "The ACCEPTOR-DISPATCH-REQUEST method on STATIC-DOCUMENT-ROOT."
  (find-method #'hunchentoot:acceptor-dispatch-request '()
               (list (find-class 'static-document-root) (find-class t))))

(defvar *serve-document-root-method*
  (make-replacing-method '(acceptor request) 'serve-document-root)
  "SERVE-DOCUMENT-ROOT as a method, to stand in Hunchentoot's last one's place.")

(defun document-root-chain (acceptor request)
  "The primary methods CALL-NEXT-METHOD would run after the document root
method for ACCEPTOR and REQUEST, Hunchentoot's last one replaced by
SERVE-DOCUMENT-ROOT."
  (substitute *serve-document-root-method* (hunchentoot-last-dispatch-method)
              (primary-methods-after (document-root-method) #'hunchentoot:acceptor-dispatch-request
                                     (list acceptor request))))

(defun dispatch-chain (acceptor request)
  "DOCUMENT-ROOT-CHAIN, kept in ACCEPTOR while still true."
  (kept-dispatch-answer (acceptor-dispatch-chain acceptor) acceptor request #'document-root-chain))

(defmethod hunchentoot:acceptor-dispatch-request ((acceptor static-document-root) request)
  "Dispatch as the methods after this one would, with the document root
served by SERVE-DOCUMENT-ROOT where Hunchentoot's own method would serve it."
  (let ((methods (dispatch-chain acceptor request)))
    (if (eq (first methods) *serve-document-root-method*)
        (serve-document-root acceptor request)
        (call-method-chain methods (list acceptor request)))))
